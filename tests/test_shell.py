"""Persistent shell sessions on a pty."""

from __future__ import annotations

import time

import pytest

from bunshin.errors import ShellExited, ToolCallError


def test_state_persists_between_calls(ws):
    sh = ws.shell()
    assert sh.run("cd /tmp && X=1 && export Y=2").exit_code == 0
    assert sh.run("echo $X $Y $PWD").stdout == b"1 2 /tmp\n"
    sh.run("greet() { echo \"hello $1\"; }")
    assert sh.run("greet agent").stdout == b"hello agent\n"
    assert sh.run("false").exit_code == 1
    assert sh.run("(exit 42)").exit_code == 42


def test_multiline_quotes_and_syntax_errors_are_one_call(ws):
    sh = ws.shell()
    r = sh.run("for i in 1 2 3; do\n  echo \"n=$i\"\ndone\necho 'single \"double\"' $((6*7))")
    assert r.stdout == b"n=1\nn=2\nn=3\nsingle \"double\" 42\n"
    r = sh.run("echo $(( 1 + ")
    assert r.exit_code == 2 and b"unexpected EOF" in r.stdout
    assert sh.run("echo ok").stdout == b"ok\n"
    r = sh.run("cat <<'EOF'\n$HOME `x` \\n\nEOF")
    assert r.stdout == b"$HOME `x` \\n\n"


def test_history_and_background_jobs(ws):
    sh = ws.shell()
    sh.run("echo first")
    sh.run("sleep 60 &")
    assert b"Running" in sh.run("jobs").stdout
    hist = sh.run("history").stdout.decode()
    assert "echo first" in hist and "sleep 60 &" in hist and "__bx_cmd" not in hist
    assert sh.run("kill %1; wait %1; echo $?").stdout.endswith(b"143\n")


def test_stderr_is_merged_like_a_terminal(ws):
    r = ws.shell().run("echo out; echo err >&2")
    assert r.stdout == b"out\nerr\n" and r.stderr == b""


def test_is_a_terminal(ws):
    r = ws.shell().run("tty; test -t 0 && test -t 1 && echo yes; stty size")
    lines = r.stdout.decode().splitlines()
    assert lines[0].startswith("/dev/pts/") and lines[1] == "yes" and lines[2] == "50 200"


def test_timeout_interrupts_foreground_job_and_session_survives(ws):
    sh = ws.shell()
    sh.run("X=kept")
    start = time.monotonic()
    r = sh.run("sleep 100", timeout=0.5)
    assert r.timed_out and r.exit_code == 130 and time.monotonic() - start < 4
    r = sh.run("cat", timeout=0.3)  # a command waiting on the terminal
    assert r.timed_out
    r = sh.run("trap '' INT; sleep 100", timeout=0.3)  # ignores ^C: needs SIGKILL
    assert r.timed_out and r.exit_code == 137
    assert sh.run("trap - INT; echo $X").stdout == b"kept\n"


def test_large_command_and_output(ws):
    sh = ws.shell()
    body = "x" * 200_000
    r = sh.run(f"v='{body}'; echo ${{#v}}")
    assert r.stdout == b"200000\n"
    r = sh.run("head -c 300000 /dev/zero | tr '\\0' a", max_output=1000)
    assert r.truncated and r.stdout == b"a" * 1000
    assert sh.run("echo fine").stdout == b"fine\n"


def test_exit_ends_the_session(ws):
    sh = ws.shell()
    sh.run("sleep 60 &")  # a job that keeps the terminal open after bash leaves
    r = sh.run("exit 3")
    assert r.exit_code == 3
    with pytest.raises(ShellExited):
        sh.run("echo x")
    assert ws.shell().run("echo new").stdout == b"new\n"


def test_several_sessions_are_independent(ws):
    a, b = ws.shell(), ws.shell()
    a.run("cd /usr")
    b.run("cd /etc")
    assert a.run("pwd").stdout == b"/usr\n" and b.run("pwd").stdout == b"/etc\n"
    a.close()
    assert b.run("echo still").stdout == b"still\n"


def test_python_repl_in_shell(ws):
    sh = ws.shell()
    r = sh.run("python3 -q -c 'import sys; print(sys.stdin.isatty())'")
    assert r.stdout == b"True\n"


def test_bad_arguments(ws):
    sh = ws.shell()
    with pytest.raises(ToolCallError):
        sh.run(["ls"])
    with pytest.raises(ToolCallError):
        sh.run("ls", timeout=0)
