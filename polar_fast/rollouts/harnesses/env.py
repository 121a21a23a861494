"""The environment every harness run starts from: private HOME, a plain PATH with the bundle's
`bin/` first, UTF-8, and the vendor-neutral "no telemetry / no update check" switches."""

from __future__ import annotations

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def base_env(*, home: str, bundle: str) -> dict[str, str]:
    return {
        "HOME": home,
        "PATH": f"{bundle}/bin:{SYSTEM_PATH}",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "DO_NOT_TRACK": "1",
        "NO_UPDATE_NOTIFIER": "1",
        "NPM_CONFIG_UPDATE_NOTIFIER": "false",
    }
