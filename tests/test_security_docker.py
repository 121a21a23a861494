"""Attacks from inside a real Docker box, run the way a rollout's harness would run them.

A box gets what a harness gets: the proxy's Unix socket (through the in-box forwarder) and its
own session token. From there it tries the admin routes, another session's token (assumed
leaked), the network, writes outside its work/home/tmp directories and a fork bomb. Each attack
must fail, and afterwards the box, the proxy and both sessions must still work. Every attack
also has a control that must succeed (a write to the repo, a model call), so a box that is
simply broken cannot pass. No traffic leaves the box: the network check only lists interfaces.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid

import aiohttp
import pytest

import polar_fast.rollouts.sandboxes.docker  # noqa: F401  (imported before the loop: import reads files)
from polar_fast.config import SandboxConfig
from polar_fast.rollouts.sandboxes import SandboxSpec, make_sandbox_factory
from polar_fast.testing import scripted_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

PORT_IN_BOX = 18080
PIDS_LIMIT = 64

# Runs inside the box (stdlib only). argv: proxy url, own token, other session's token, workdir,
# home. Prints one JSON object: attack name -> what happened.
ATTACKS = r'''
import errno, json, os, sys, time, urllib.request, urllib.error
url, own, other, workdir, home = sys.argv[1:6]

def http(method, path, token=None, body=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    req = urllib.request.Request(url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return "error: %s" % e

out = {"uid": os.getuid(), "gid": os.getgid()}
out["create_session"] = http("POST", "/sessions", body=b"{}")
out["create_session_with_own_token"] = http("POST", "/sessions", own, b"{}")
out["read_other_records"] = http("GET", "/sessions/%s/records" % other, own)
out["read_own_records"] = http("GET", "/sessions/%s/records" % own, own)
out["end_other_session"] = http("DELETE", "/sessions/%s" % other, own)
out["end_other_session_no_key"] = http("DELETE", "/sessions/%s" % other)
out["interfaces"] = sorted(os.listdir("/sys/class/net"))

writes = {}
for path in ["/etc/polar-attack", "/usr/polar-attack", "/polar-attack", "/opt/polar/forwarder.py",
             "/run/polar/polar-attack", workdir + "/polar-ok", home + "/polar-ok", "/tmp/polar-ok"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        writes[path] = "written"
    except OSError as e:
        writes[path] = errno.errorcode.get(e.errno, str(e.errno))
out["writes"] = writes

children, fork_error = [], None
for _ in range(FORK_TRIES):
    try:
        pid = os.fork()
    except OSError as e:
        fork_error = errno.errorcode.get(e.errno, str(e.errno))
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children.append(pid)
out["forks"] = len(children)
out["fork_error"] = fork_error
for pid in children:
    os.kill(pid, 9)
for pid in children:
    os.waitpid(pid, 0)
print(json.dumps(out))
'''.replace("FORK_TRIES", str(PIDS_LIMIT * 4))

MODEL_CALL = r'''
import json, sys, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json", "Authorization": "Bearer " + sys.argv[2]})
with urllib.request.urlopen(req, timeout=30) as r:
    print(r.status)
'''


@pytest.fixture
def short_dir():
    """A short directory for the proxy's socket (Unix socket paths cap at ~108 bytes)."""
    path = tempfile.mkdtemp(prefix="polar-sec-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ok(status) -> bool:
    return isinstance(status, int) and 200 <= status < 300


async def test_attacks_from_a_network_none_box_all_fail_and_the_run_continues(base_image, tmp_path, short_dir):
    sock = f"{short_dir}/proxy.sock"
    async with scripted_proxy(tmp_path, ["ok"], unix_socket=sock, cycle=True) as px:
        other = await px.new_session("rollout-other", "group-other")
        factory = make_sandbox_factory(SandboxConfig(kind="docker", cpus=1.0, memory_mb=512, pids_limit=PIDS_LIMIT, disk_mb=128),
                                       run_id=f"t-sec-{uuid.uuid4().hex[:8]}")
        try:
            spec = SandboxSpec(name="attacker", proxy_port=PORT_IN_BOX, proxy_socket=sock)
            async with factory.open(spec) as box:
                done = await box.exec(["python3", "-c", ATTACKS, box.proxy_url, px.token, other, box.workdir, box.home],
                                      timeout_s=120)
                assert done.exit_code == 0, done.stderr
                seen = json.loads(done.stdout.strip().splitlines()[-1])
                print("attacks:", json.dumps(seen, indent=1))  # the evidence, also when it passes

                # the box runs as an unprivileged user
                assert seen["uid"] != 0 and seen["gid"] != 0
                # admin routes: not served to a box at all, with or without its own token
                for attack in ("create_session", "create_session_with_own_token", "read_other_records",
                               "read_own_records", "end_other_session", "end_other_session_no_key"):
                    assert not _ok(seen[attack]), (attack, seen[attack])
                assert set(px.proxy.state.sessions) == {px.token, other}  # none created, none ended
                # network: loopback only (nothing is sent anywhere to find out)
                assert seen["interfaces"] == ["lo"]
                # writes: only the repo, home and tmp take them
                writes = seen["writes"]
                for path in (f"{box.workdir}/polar-ok", f"{box.home}/polar-ok", "/tmp/polar-ok"):
                    assert writes[path] == "written", (path, writes)
                for path, result in writes.items():
                    if not path.endswith("polar-ok"):
                        assert result != "written", (path, writes)
                # fork bomb: stopped by the pids limit, not by running out of the loop
                assert seen["fork_error"] == "EAGAIN" and 0 < seen["forks"] < PIDS_LIMIT

                # the run continues: the box still runs commands and its own session still answers
                again = await box.exec(["python3", "-c", MODEL_CALL, box.proxy_url, px.token], timeout_s=60)
                assert again.exit_code == 0 and again.stdout.strip() == "200", again.stderr
                assert len(await px.records()) == 1
        finally:
            assert await factory.remove_leftovers() == 0  # the box was removed by its block
            await factory.aclose()
        # the leaked-token session is still open and usable from the host
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(f"{px.root_url}/s/{other}/v1/chat/completions", json=body) as r:
                assert r.status == 200
        logged = await px.logged()
        assert {c.rollout_id for c in logged} == {"rollout-0", "rollout-other"}


async def test_host_network_box_needs_the_admin_key(base_image, tmp_path):
    """With host networking the box shares the host's loopback, so the proxy's TCP port is
    reachable: the admin routes there must need a key the box never sees."""
    from polar_fast.config import parse_config
    from polar_fast.rollouts.stack import with_admin_key

    cfg = with_admin_key(parse_config({"sandbox": {"kind": "docker", "network": "host"}}))
    assert cfg.proxy.admin_key  # generated for the run
    async with scripted_proxy(tmp_path, ["ok"], config={"proxy": {"admin_key": cfg.proxy.admin_key}}) as px:
        factory = make_sandbox_factory(cfg.sandbox, run_id=f"t-sec-{uuid.uuid4().hex[:8]}")
        port = int(px.root_url.rsplit(":", 1)[1])
        probe = ("import sys, urllib.request, urllib.error\n"
                 "req = urllib.request.Request(sys.argv[1] + '/sessions', data=b'{}', method='POST',\n"
                 "    headers={'Authorization': 'Bearer ' + sys.argv[2]})\n"
                 "try:\n    print(urllib.request.urlopen(req, timeout=20).status)\n"
                 "except urllib.error.HTTPError as e:\n    print(e.code)\n")
        try:
            async with factory.open(SandboxSpec(name="host-net", proxy_port=port)) as box:
                done = await box.exec(["python3", "-c", probe, box.proxy_url, px.token], timeout_s=60)
                assert done.exit_code == 0, done.stderr
                assert done.stdout.strip() == "401"
                assert len(px.proxy.state.sessions) == 1
        finally:
            await factory.remove_leftovers()
            await factory.aclose()
