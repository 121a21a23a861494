"""The view's aiohttp app: static pages, a small JSON API over `RunData`, and the key check.

Pages are static files (static/: HTML, one script, one stylesheet, no build step) that fetch
JSON. The rollout table is paged on the server (`/api/rollouts?offset=&limit=`), and a rollout's
conversation and tokens are fetched only when that rollout is opened, so a run of any size sends
the browser one page of rows at a time. Every API call refreshes the index first, so a reload
shows what a live run appended. Bad input gets a page or JSON error that says what is wrong; an
unexpected error in one request is answered 500 with its message and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import traceback
from html import escape
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from polar_fast.config import LAYOUTS
from polar_fast.report.view.run_data import RolloutRow, RunData

STATIC = Path(__file__).with_name("static")
DATA = web.AppKey("data", RunData)
KEY = web.AppKey("key", str)
KEY_COOKIE = "polar_view_key"
SORTABLE = ("order", "rollout_id", "task_id", "harness", "reward", "outcome", "n_calls", "sampled_tokens",
            "duration_s", "version_max", "rendered_calls")
MAX_PAGE_ROWS = 500


def error_page(status: int, title: str, detail: str) -> web.Response:
    body = (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<link rel='stylesheet' href='/static/view.css'></head><body><main class='error-page'>"
            f"<h1 id='error-title'>{escape(title)}</h1><p id='error-detail'>{escape(detail)}</p>"
            f"<p><a href='/'>run</a> · <a href='/rollouts'>rollouts</a></p></main></body></html>")
    return web.Response(status=status, text=body, content_type="text/html")


def _wants_json(request: web.Request) -> bool:
    return request.path.startswith("/api/")


def _error(request: web.Request, status: int, title: str, detail: str) -> web.Response:
    if _wants_json(request):
        return web.json_response({"error": title, "detail": detail}, status=status)
    return error_page(status, title, detail)


@web.middleware
async def key_check(request: web.Request, handler):
    key = request.app[KEY]
    if not key:
        return await handler(request)
    given = request.query.get("key") or request.cookies.get(KEY_COOKIE, "")
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        given = auth[len("Bearer "):]
    if not hmac.compare_digest(given.encode(), key.encode()):
        return _error(request, 401, "This view needs its key",
                      "Open the address printed by `python -m polar_fast view` (it ends in ?key=...).")
    if "key" in request.query and not _wants_json(request):  # keep the key out of later links
        response = web.HTTPFound(request.rel_url.with_query({k: v for k, v in request.query.items() if k != "key"}))
        response.set_cookie(KEY_COOKIE, key, httponly=True, samesite="Strict")
        raise response
    return await handler(request)


@web.middleware
async def clear_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        detail = e.text if e.text and not e.text.startswith(f"{e.status}:") else ""
        return _error(request, e.status, e.reason, detail)
    except Exception as e:  # one bad request must not take the view down
        traceback.print_exc()
        return _error(request, 500, f"The view failed on this request: {type(e).__name__}", str(e))


async def _refreshed(request: web.Request) -> RunData:
    data = request.app[DATA]
    await asyncio.to_thread(data.refresh)
    return data


async def index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


async def rollout_page(request: web.Request) -> web.StreamResponse:
    data = await _refreshed(request)
    rid = request.match_info["rollout_id"]
    if rid not in data.rollouts:
        return error_page(404, f"No rollout {rid!r} in this run",
                          f"{data.run_dir} has {len(data.rollouts)} rollouts; the table lists them.")
    return web.FileResponse(STATIC / "index.html")


async def api_run(request: web.Request) -> web.Response:
    data = await _refreshed(request)
    metrics, metrics_note = await asyncio.to_thread(data.metrics)
    notes = [metrics_note] if metrics_note else []
    if not data.has_log:
        notes.append("no records.log yet: nothing has been captured")
    ended = data.ended
    if data.live:
        state = "running"
    elif ended is not None:
        state = f"ended: {ended.reason}"
    else:
        state = "ended without a run-end marker: killed or crashed" if data.has_log else "not started"
    return web.json_response({
        "run_dir": str(data.run_dir), "config": data.config, "state": state, "live": data.live,
        "steps": data.learner_steps(metrics),
        "rollouts": len(data.rollouts), "outcomes": data.outcome_counts(),
        "torn": {"bytes": data.torn_bytes, "reason": data.torn_reason} if data.torn_bytes else None,
        "metrics": metrics, "notes": notes,
    })


def _matches(row: RolloutRow, q: str, outcome: str) -> bool:
    if outcome and row.outcome != outcome:
        return False
    return not q or any(q in str(v).lower() for v in (row.rollout_id, row.task_id, row.harness, row.group_id))


def _sorted(rows: list[RolloutRow], field: str, desc: bool) -> list[RolloutRow]:
    """By `field`, either way, with rows that have no value (no reward yet, or never) last."""
    have = [r for r in rows if getattr(r, field) is not None]
    have.sort(key=lambda r: getattr(r, field), reverse=desc)
    return have + [r for r in rows if getattr(r, field) is None]


async def api_rollouts(request: web.Request) -> web.Response:
    data = await _refreshed(request)
    q = request.query
    try:
        offset = max(int(q.get("offset", 0)), 0)
        limit = min(max(int(q.get("limit", 50)), 1), MAX_PAGE_ROWS)
    except ValueError:
        raise web.HTTPBadRequest(reason="offset and limit must be integers") from None
    field = q.get("sort", "order")
    if field not in SORTABLE:
        raise web.HTTPBadRequest(reason=f"cannot sort by {field!r}; one of {', '.join(SORTABLE)}")
    rows = [r for r in data.rollouts.values() if _matches(r, q.get("q", "").lower(), q.get("outcome", ""))]
    rows = _sorted(rows, field, q.get("desc") == "1")
    return web.json_response({"total": len(data.rollouts), "matching": len(rows), "offset": offset,
                              "rows": [r.as_json() for r in rows[offset: offset + limit]]})


def group_status(members: list[RolloutRow], decision: dict | None) -> dict[str, Any]:
    """Whether the learner trained on this group, and in words why not (mirrors grpo.py: infra
    errors never score; a group whose rewards are all equal has no advantage and is skipped; a
    group too many policy versions behind is withheld)."""
    rewards = {r.rollout_id: r.reward for r in members}
    running = [r for r in members if r.outcome == "running"]
    abandoned = [r for r in members if r.outcome == "abandoned"]
    scored = [r.reward for r in members if r.outcome != "infra_error" and r.reward is not None]
    status = (decision or {}).get("status")
    if running:
        text, trained = f"not trained yet: {len(running)} of its rollouts still running", False
    elif abandoned and status != "trained":
        text, trained = (f"did not train: the run ended before the group finished ({len(abandoned)} of its "
                         "rollouts abandoned)"), False
    elif status == "interrupted":
        text, trained = (f"did not train: the run was stopped during learner step {decision.get('step')}, before "
                         "its update"), False
    elif status == "withheld":
        text, trained = (f"did not train: withheld, its calls were more than run.max_staleness policy versions "
                         f"behind the learner (step {decision.get('step')})"), False
    elif len(scored) < 2 or max(scored) == min(scored):
        text = f"did not train: zero-variance group (rewards {sorted(scored)}), so every advantage is 0"
        trained = False
    elif status == "trained":
        text, trained = f"trained in learner step {decision.get('step')}", True
    else:
        text, trained = "not trained yet: waiting for a learner step", False
    return {"trained": trained, "text": text, "rewards": rewards, "step": (decision or {}).get("step")}


def _conversations(exchanges) -> list[dict[str, Any]]:
    from polar_fast.export import final_conversations

    out = []
    for final, messages in final_conversations(exchanges):
        out.append({"session_id": final.session_id, "call_index": final.call_index, "model": final.model,
                    "tools": [t.name for t in final.tools], "messages": msgspec.to_builtins(messages)})
    return out


async def _rollout(request: web.Request):
    data = await _refreshed(request)
    rid = request.match_info["rollout_id"]
    if rid not in data.rollouts:
        raise web.HTTPNotFound(reason=f"No rollout {rid!r} in this run")
    return data, await asyncio.to_thread(data.rollout_records, rid)


async def api_rollout(request: web.Request) -> web.Response:
    data, rec = await _rollout(request)
    decision = (await asyncio.to_thread(data.group_steps)).get(rec.row.group_id)
    group = group_status(data.group(rec.row.group_id), decision)
    if rec.row.outcome == "infra_error":
        group = group | {"trained": False, "text": "did not train: an infra error is never scored"}
    return web.json_response({"row": rec.row.as_json(), "group": group,
                              "conversations": await asyncio.to_thread(_conversations, rec.exchanges)})


def _run_setting(data: RunData, section: str, key: str, default: Any) -> Any:
    return ((data.config or {}).get(section) or {}).get(key, default)


async def api_tokens(request: web.Request) -> web.Response:
    from polar_fast.model import load_tokenizer
    from polar_fast.report.view.tokens import token_view

    data, rec = await _rollout(request)
    layout = request.query.get("layout") or _run_setting(data, "merge", "layout", "tree")
    if layout not in LAYOUTS:
        raise web.HTTPBadRequest(reason=f"layout must be {' or '.join(LAYOUTS)}, not {layout!r}")
    tokenizer = await asyncio.to_thread(load_tokenizer, _run_setting(data, "model", "path", ""))
    view = await asyncio.to_thread(token_view, rec.calls, layout=layout, tokenizer=tokenizer)
    return web.json_response(view)


async def api_sft(request: web.Request) -> web.Response:
    from polar_fast.export import chat_rows_of, token_rows_of

    data, rec = await _rollout(request)
    if rec.rollout is None:
        raise web.HTTPConflict(reason="this rollout is still running: it has no reward to export yet")
    model = rec.exchanges[-1].model if rec.exchanges else ""  # as `polar_fast export` names it
    body = await asyncio.to_thread(lambda: json.dumps({
        "chat": chat_rows_of(rec.rollout, rec.exchanges, rec.calls),
        "tokens": token_rows_of(rec.rollout, rec.calls, model)}))
    return web.Response(text=body, content_type="application/json", headers={
        "Content-Disposition": f'attachment; filename="{rec.row.rollout_id}.sft.json"'})


async def api_unknown(request: web.Request) -> web.Response:
    raise web.HTTPNotFound(reason=f"no API route {request.path}")


def make_app(run_dir: Path, *, key: str = "") -> web.Application:
    app = web.Application(middlewares=[clear_errors, key_check])
    app[DATA] = RunData(run_dir)
    app[KEY] = key
    app.router.add_get("/", index)
    app.router.add_get("/rollouts", index)
    app.router.add_get("/rollouts/{rollout_id}", rollout_page)
    app.router.add_static("/static", STATIC)
    app.router.add_get("/api/run", api_run)
    app.router.add_get("/api/rollouts", api_rollouts)
    app.router.add_get("/api/rollouts/{rollout_id}", api_rollout)
    app.router.add_get("/api/rollouts/{rollout_id}/tokens", api_tokens)
    app.router.add_get("/api/rollouts/{rollout_id}/sft", api_sft)
    app.router.add_get("/api/{tail:.*}", api_unknown)
    return app
