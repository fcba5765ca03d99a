"""The asyncio API: awaitable tool calls (many in flight on one event loop), forks, snapshots
and closes; cancelling a call kills it and leaves the workspace or session usable."""

from __future__ import annotations

import asyncio
import time

import pytest

import bunshin


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def _sleeps(ws) -> list:
    return [p for p in ws.processes() if p.cmdline[:1] == ["sleep"]]


def test_many_calls_in_flight_on_one_loop(ws):
    async def main():
        ws.write_file("/in.txt", b"hello\n")
        tpl = await ws.asnapshot()
        kids = await tpl.afork(8)
        try:
            t0 = time.monotonic()
            calls = [k.arun(f"sleep 0.5; echo {i}-$(cat /in.txt)") for i in range(12) for k in kids]
            results = await asyncio.gather(*calls)
            took = time.monotonic() - t0
            # 96 calls of 0.5 s each: one after another they take 48 s
            assert took < 15, took
            want = [f"{i}-hello\n".encode() for i in range(12) for _k in kids]
            assert [r.stdout for r in results] == want
            assert all(r.ok for r in results)
        finally:
            await asyncio.gather(*(k.aclose() for k in kids))
            await tpl.aclose()
    _run(main())


def test_results_match_the_blocking_calls(ws):
    async def main():
        for cmd, kw in [("echo out; echo err >&2; exit 3", {}), ("cat", {"stdin": b"in put"}),
                        ("head -c 300000 /dev/zero", {"max_output": 1000}),
                        ("kill -9 $$", {}), ("no-such-command", {}), ("pwd", {"cwd": "/tmp"}),
                        ("echo $X", {"env": {"X": "y"}})]:
            a, b = await ws.arun(cmd, **kw), ws.run(cmd, **kw)
            assert (a.stdout, a.stderr, a.exit_code, a.signal, a.truncated, a.timed_out) == \
                   (b.stdout, b.stderr, b.exit_code, b.signal, b.truncated, b.timed_out), cmd
        r = await ws.aexec(["printf", "%s", "a b"])
        assert r.stdout == b"a b"
    _run(main())


def test_a_timeout_kills_the_call_and_the_workspace_runs_on(ws):
    async def main():
        r = await ws.arun("sleep 100 & sleep 100; echo never", timeout=0.5)
        assert r.timed_out and r.stdout == b""
        assert (await ws.arun("echo ok")).stdout == b"ok\n"
    _run(main())
    deadline = time.monotonic() + 5
    while _sleeps(ws) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _sleeps(ws)


def test_cancelling_a_call_kills_its_process_group(ws):
    async def main():
        call = asyncio.ensure_future(ws.arun("sleep 100 & sleep 100; echo never"))
        while not _sleeps(ws):
            await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await ws.arun("echo ok")).stdout == b"ok\n"
        for _ in range(100):
            if not _sleeps(ws):
                break
            await asyncio.sleep(0.05)
        assert not _sleeps(ws)
        await asyncio.sleep(0.1)  # the cancelled call's exit report is collected, not kept
        assert not ws.live_channel()._exits
    _run(main())


def test_cancelling_at_any_point_leaves_no_process_and_no_exit_report(ws):
    """A call cancelled before the init has answered its start (the process starts all the
    same), while it runs, or as its exit report arrives: the process ends, and the channel
    keeps nothing for it."""
    async def main():
        for delay in [None, 0, 0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05]:
            call = asyncio.ensure_future(ws.arun("sleep 100 & sleep 100"))
            if delay is not None:
                await asyncio.sleep(delay)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        for _ in range(300):  # the reapers' kills and exit reports, on a loaded machine
            chan = ws.live_channel()
            if not _sleeps(ws) and not chan._exits and not chan._exit_futures:
                break
            await asyncio.sleep(0.05)
        assert not _sleeps(ws)
        assert not chan._exits and not chan._exit_futures
        assert (await ws.arun("echo ok")).stdout == b"ok\n"
    _run(main())


@pytest.mark.parametrize("turns", [0, 1, 2])
def test_an_exit_wait_cancelled_as_its_status_arrives_hands_the_status_on(ws, turns):
    """The exit report arrives for a wait that is cancelled then (at once, or once the event
    loop has run on a turn or two: the status given, the wait not yet resumed), as the
    cancelled call's own wait is when its reaper starts: the next wait gets the status."""
    from bunshin.runtime.channel import _EXITED, _HDR, PROTO

    async def main():
        chan = ws.live_channel()
        pid = await chan.aspawn(["sleep", "100"], ["PATH=/usr/bin:/bin"], "/", [])
        wait = asyncio.ensure_future(chan.await_exit(pid))
        while pid not in chan._exit_futures:
            await asyncio.sleep(0)
        payload = _EXITED.pack(pid, 9)
        chan._dispatch(_HDR.pack(PROTO["REP_EXITED"], 0, 0, len(payload), 0) + payload)
        for _ in range(turns):
            await asyncio.sleep(0)
        wait.cancel()
        try:
            await wait
        except asyncio.CancelledError:
            assert chan.poll_exit(pid) == 9
        else:
            assert wait.result() == 9  # it had resumed: the status is its own
        await chan.aend(pid)
        assert not chan._exits and not chan._exit_futures
    _run(main())


def test_shell_calls_keep_their_session_and_cancel_cleanly(ws):
    async def main():
        sh = ws.shell()
        await sh.arun("cd /tmp && X=7")
        assert (await sh.arun("echo $X $PWD")).stdout == b"7 /tmp\n"
        call = asyncio.ensure_future(sh.arun("sleep 100"))
        while not _sleeps(ws):
            await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await sh.arun("echo $X")).stdout == b"7\n"
        assert not _sleeps(ws)
    _run(main())


def test_forks_and_closes_await(ws):
    async def main():
        await ws.arun("echo 1 > /f")
        (kid,) = await ws.afork(1)
        await kid.arun("echo 2 > /f")
        assert (await ws.arun("cat /f")).stdout == b"1\n"
        assert (await kid.arun("cat /f")).stdout == b"2\n"
        await kid.aclose()
        assert kid.closed
        with pytest.raises(bunshin.WorkspaceClosed):
            await kid.arun("true")
    _run(main())


def test_tools_await_on_the_loop(ws):
    from bunshin.cache import ToolCall
    from bunshin.cache.tools import BUILTIN_TOOLS, ToolContext, arun_tool, run_tool

    async def shout(ctx, text):
        return (await ctx.ws.arun(f"echo {text} | tr a-z A-Z")).stdout

    tools = {**BUILTIN_TOOLS, "shout": shout}
    sh = ws.shell()
    ctx = ToolContext(ws, lambda: sh)

    async def main():
        calls = [ToolCall("bash", {"command": "cd /tmp; echo $PWD"}),
                 ToolCall("python", {"code": "print(6 * 7)"}),
                 ToolCall("write_file", {"path": "/w", "content": "x"}),
                 ToolCall("read_file", {"path": "/w"}), ToolCall("shout", {"text": "hi"})]
        got = [(await arun_tool(tools, ctx, c)).stdout for c in calls]
        assert got == [b"/tmp\n", b"42\n", b"", b"x", b"HI\n"]
        # the blocking path gives the same for the same calls
        assert [run_tool(tools, ctx, c).stdout for c in calls[:4]] == got[:4]
    _run(main())
