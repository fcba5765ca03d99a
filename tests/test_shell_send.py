"""Shell.send: typing on a session's terminal for programs Shell.run cannot drive."""

from __future__ import annotations

import pytest

import bunshin


def test_repl_interrupt_and_prompt(ws):
    sh = ws.shell(cwd="/tmp")
    sh.run("X=kept")
    assert sh.send("python3 -q\n", until=[">>> "], timeout=10) == (b"", ">>> ")
    assert sh.send("print(6 * 7)\n", until=[">>> "], timeout=10) == (b"42\n", ">>> ")
    assert sh.send("import sys; sys.exit(3)\n", timeout=10) == (b"", 3)  # bash's prompt: the exit status
    assert sh.run("echo $X").stdout == b"kept\n"

    out, hit = sh.send("echo started; sleep 30\n", timeout=0.5)
    assert (out, hit) == (b"started\n", None)  # nothing interrupted
    assert sh.send("\x03", timeout=5)[1] == 130  # ^C: the job's SIGINT status
    assert sh.run("echo after").stdout == b"after\n"

    # what follows a match stays for the next call
    assert sh.send("echo one; echo two\n", until=["one\n"], timeout=5) == (b"", "one\n")
    assert sh.send("", until=["two\n"], timeout=5) == (b"", "two\n")
    assert sh.send("", timeout=5) == (b"", 0)  # its prompt, before run() can tell its own
    assert sh.run("echo three").stdout == b"three\n"

    with pytest.raises(bunshin.errors.ShellExited):
        sh.send("exit 0\n", timeout=5)
