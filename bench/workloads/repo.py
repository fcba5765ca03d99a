"""``repo``: a coding agent on a real Python repository (the default workload).

Repository: more-itertools 10.5.0, its PyPI sdist (source, docs and its real unittest/pytest
suite, 660+ tests, ~2 s). Setup (every step offline; the workspace has loopback only):

1. the sdist and an offline wheelhouse (pytest 8.3.5, pluggy 1.5.0, iniconfig 2.0.0,
   packaging 24.2, flit_core 3.9.0 — the sdist's build backend) are written into the
   workspace as base64 and decoded (so no host path needs to be visible);
2. the sdist is unpacked to ``/repo`` and committed to a git repository there;
3. ``pip install --no-index --find-links /tmp/wheelhouse pytest flit_core`` and
   ``pip install --no-index --no-build-isolation --no-deps -e /repo``;
4. a long-lived Python "language server" (``/srv/indexd/indexd.py``, HTTP on 127.0.0.1:8765)
   imports the package, parses every ``.py`` of the repository and then of the Python
   standard library into ASTs and keeps them (with the sources and a symbol table) until its
   resident set reaches ``server_mib`` MiB; it answers ``/health``, ``/def?name=`` and
   ``/refs?name=``. ``ready`` polls ``/health``.

Traces: a shared exploration prefix (``ls``, git, ``grep -n`` of the API, a baseline run of
the whole test suite, ``pyproject.toml``, a language-server query), then per member one target function (chunked, first, ilen, take,
tail, nth) and one plan: ``fix`` (break it with a realistic bug, see the test fail, read the
diff, revert, tests pass), ``refactor`` (a behaviour-preserving edit, targeted then whole-file
tests), ``addtest`` (write a new test file with ``write_file``, run it, probe with the python
tool, run the whole suite) or ``probe`` (python-tool experiments, a doc edit, the targeted
tests). (target, plan) pairs are drawn without replacement from a seeded shuffle.
"""

from __future__ import annotations

import itertools

from bunshin.rl import Task

from ._base import Workload, bash, fetch, join_members, member_rng, py, read, stage_files, write

SDIST = ("more-itertools==10.5.0", "more-itertools-10.5.0.tar.gz")
WHEELS = [
    ("pytest==8.3.5", "pytest-8.3.5-py3-none-any.whl"),
    ("pluggy==1.5.0", "pluggy-1.5.0-py3-none-any.whl"),
    ("iniconfig==2.0.0", "iniconfig-2.0.0-py3-none-any.whl"),
    ("packaging==24.2", "packaging-24.2-py3-none-any.whl"),
    ("flit_core==3.9.0", "flit_core-3.9.0-py3-none-any.whl"),
]
PORT = 8765
DL = "/tmp/wheelhouse"

INDEXD = r'''
"""A toy language server: keeps ASTs of the repository and the stdlib, answers over HTTP."""
import ast, json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

import more_itertools  # the package under work, imported as an IDE backend would

TARGET_MIB, PORT = int(sys.argv[1]), int(sys.argv[2])
ROOTS = ["/repo", "/usr/lib/python3.11"]


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


sources, trees, symbols = {}, {}, {}
t0 = time.monotonic()


def index(path):
    try:
        with open(path, encoding="utf-8") as f:
            src = f.read()
        tree = ast.parse(src, path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    sources[path], trees[path] = src, tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            symbols.setdefault(node.name, []).append((path, node.lineno, kind))


def walk():
    for root in ROOTS:
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", ".git", "test", "tests")
                             or root == "/repo")
            for name in sorted(files):
                if name.endswith(".py"):
                    index(os.path.join(d, name))
                    if root != "/repo" and rss_mib() >= TARGET_MIB:
                        return


walk()
index_s = time.monotonic() - t0


class H(BaseHTTPRequestHandler):
    def do_GET(self):
        u = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        name = q.get("name", "")
        if u.path == "/health":
            out = {"ok": True, "files": len(trees), "symbols": len(symbols),
                   "rss_mib": round(rss_mib(), 1), "target_mib": TARGET_MIB,
                   "index_s": round(index_s, 2), "more_itertools": more_itertools.__version__}
        elif u.path == "/def":
            out = [{"path": p, "line": l, "kind": k} for p, l, k in symbols.get(name, [])
                   if p.startswith("/repo/")] or [{"path": p, "line": l, "kind": k}
                                                 for p, l, k in symbols.get(name, [])[:10]]
        elif u.path == "/refs":
            out = [{"path": p, "line": i + 1, "text": line.strip()}
                   for p, s in sources.items() if p.startswith("/repo/")
                   for i, line in enumerate(s.splitlines()) if name and name in line][:50]
        else:
            self.send_error(404)
            return
        body = json.dumps(out, indent=1).encode() + b"\n"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


HTTPServer(("127.0.0.1", PORT), H).serve_forever()
'''

# target: (function, module file, test file, test class,
#          bad edit (sed script), good edit (sed script), python probe, new test body)
TARGETS = {
    "chunked": ("more.py", "test_more.py", "ChunkedTests",
                r"/^def chunked(/,/^def first(/s/if len(chunk) != n:/if len(chunk) > n:/",
                r"/^def chunked(/,/^def first(/s/iterable is not divisible by n\./"
                r"iterable is not divisible by n; pass strict=False to allow a short last chunk./",
                "list(mi.chunked(range(10), 3))",
                "self.assertEqual(list(mi.chunked('abcdefg', 3)), [['a', 'b', 'c'], ['d', 'e', 'f'], ['g']])\n"
                "        with self.assertRaises(ValueError):\n"
                "            list(mi.chunked(range(7), 2, strict=True))"),
    "first": ("more.py", "test_more.py", "FirstTests",
              r"/^def first(/,/^def last(/s/^    return default$/    return None/",
              r"/^def first(/,/^def last(/s/It is marginally shorter than/It is slightly shorter than/",
              "mi.first([], 'empty'), mi.first(iter('xyz'))",
              "self.assertEqual(mi.first(x * x for x in range(3, 6)), 9)\n"
              "        self.assertEqual(mi.first([], default=None), None)\n"
              "        with self.assertRaises(ValueError):\n"
              "            mi.first(())"),
    "ilen": ("more.py", "test_more.py", "IlenTests",
             r"/^def ilen(/,/^def iterate(/s/return sum(compress(repeat(1), zip(iterable)))/"
             r"return sum(compress(repeat(1), zip(iterable))) - 1/",
             r"/^def ilen(/,/^def iterate(/s/return sum(compress(repeat(1), zip(iterable)))/"
             r"return sum(1 for _ in iterable)/",
             "mi.ilen(x for x in range(1000) if x % 7 == 0)",
             "self.assertEqual(mi.ilen(iter(range(12345))), 12345)\n"
             "        self.assertEqual(mi.ilen([]), 0)"),
    "take": ("recipes.py", "test_recipes.py", "TakeTests",
             r"/^def take(/,/^def tabulate(/s/return list(islice(iterable, n))/"
             r"return list(islice(iterable, n - 1))/",
             r"/^def take(/,/^def tabulate(/s/If there are fewer than \*n\* items in the iterable, all of them are/"
             r"If the iterable has fewer than *n* items, all of them are/",
             "mi.take(3, range(10)), mi.take(10, 'ab')",
             "self.assertEqual(mi.take(2, iter('abc')), ['a', 'b'])\n"
             "        self.assertEqual(mi.take(0, range(5)), [])"),
    "tail": ("recipes.py", "test_recipes.py", "TailTests",
             r"/^def tail(/,/^def consume(/s/max(0, len(iterable) - n)/max(0, len(iterable) - n + 1)/",
             r"/^def tail(/,/^def consume(/s/yield from iter(deque(iterable, maxlen=n))/"
             r"yield from deque(iterable, maxlen=n)/",
             "list(mi.tail(3, 'ABCDEFG')), list(mi.tail(2, iter(range(5))))",
             "self.assertEqual(list(mi.tail(2, iter('abcd'))), ['c', 'd'])\n"
             "        self.assertEqual(list(mi.tail(5, [1, 2])), [1, 2])"),
    "nth": ("recipes.py", "test_recipes.py", "NthTests",
            r"/^def nth(/,/^def all_equal(/s/return next(islice(iterable, n, None), default)/"
            r"return next(islice(iterable, n + 1, None), default)/",
            r"/^def nth(/,/^def all_equal(/s/Returns the nth item or a default value./"
            r"Return the nth item or a default value./",
            "mi.nth(range(10), 3), mi.nth('abc', 9, 'zebra')",
            "self.assertEqual(mi.nth(iter('abcdef'), 4), 'e')\n"
            "        self.assertEqual(mi.nth([], 0, 'x'), 'x')"),
}
PLANS = ("fix", "refactor", "addtest", "probe")
PYTEST = "python3 -m pytest -q -p no:cacheprovider"


def _new_test(fn: str, body: str) -> str:
    return ("from unittest import TestCase\n\nimport more_itertools as mi\n\n\n"
            f"class Agent{fn.capitalize()}Tests(TestCase):\n"
            f"    def test_{fn}_examples(self):\n        {body}\n")


def _member(fn: str, plan: str, quick: bool, i: int) -> tuple[list, list]:
    mod, tfile, tclass, bad, good, probe, body = TARGETS[fn]
    src, tpath = f"more_itertools/{mod}", f"tests/{tfile}"
    targeted = f"{PYTEST} {tpath} -k {tclass}"
    steps: list = []

    def add(call, code=0):
        steps.append((call, code))

    # explore the target (every plan)
    add(bash(f"grep -rn 'def {fn}(' more_itertools/"))
    if not quick:
        add(bash(f"curl -s 'http://127.0.0.1:{PORT}/refs?name={fn}(' | head -30"))
        add(bash(f"sed -n '/^def {fn}(/,/^def /p' {src}"))
        add(bash(f"grep -n 'class {tclass}' -A 25 {tpath}"))
    if plan == "fix":
        add(bash(f"sed -i '{bad}' {src} && ! git diff --quiet -- {src} && git diff --stat"))
        add(bash(targeted), 1)
        if not quick:
            add(bash("git diff"))
            add(bash(f"{targeted} 2>&1 | grep -E '^E |Error|assert' | head -20"))
        add(bash(f"git checkout -- {src} && {targeted}"))
        if not quick:
            add(bash(f"{PYTEST} tests/"))
    elif plan == "refactor":
        add(bash(f"sed -i '{good}' {src} && ! git diff --quiet -- {src} && git diff"))
        add(bash(targeted))
        if not quick:
            add(py(f"import more_itertools as mi; print({probe})"))
            add(bash(f"{PYTEST} {tpath}"))
            add(bash("git status --short && git diff --stat"))
    elif plan == "addtest":
        new = f"tests/test_agent_{fn}_{i}.py"
        add(write(f"/repo/{new}", _new_test(fn, body)))
        add(bash(f"{PYTEST} {new}"))
        if not quick:
            add(read(f"/repo/{new}"))
            add(py(f"import more_itertools as mi; print({probe})"))
            add(bash(f"{PYTEST} tests/ -x"))
    elif plan == "probe":
        add(py(f"import more_itertools as mi; print({probe})"))
        if not quick:
            add(py(f"import inspect, more_itertools as mi; print(inspect.getsource(mi.{fn}))"))
            add(bash(f"sed -i '{good}' {src} && ! git diff --quiet -- {src} && git diff --stat"))
        add(bash(targeted))
        if not quick:
            add(bash(f"{PYTEST} --doctest-modules {src}"))
    return [c for c, _ in steps], [e for _, e in steps]


def make(group_size: int, seed: int = 0, quick: bool = False) -> Workload:
    """The ``repo`` workload for ``group_size`` members (see the module docstring)."""
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    server_mib = 48 if quick else 160
    sdist = fetch(SDIST[0], SDIST[1], sdist=True)
    wheels = [fetch(req, fn, sdist=False) for req, fn in WHEELS]

    setup = [
        *stage_files([sdist, *wheels], DL),
        bash("git config --global core.pager cat && git config --global color.ui never "
             "&& git config --global user.name dev && git config --global user.email dev@example.com"),
        bash(f"mkdir -p /repo && tar xzf {DL}/{SDIST[1]} -C /repo --strip-components=1 && cd /repo "
             "&& git init -q -b main && git add -A && git commit -q -m 'more-itertools 10.5.0 (sdist)' && git log --oneline"),
        bash(f"python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "
             f"--break-system-packages --no-index --find-links {DL} pytest flit_core"),
        bash("cd /repo && python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "
             "--break-system-packages --no-index --no-build-isolation --no-deps -e ."),
        write("/srv/indexd/indexd.py", INDEXD.lstrip()),
        bash(f"cd /repo && setsid nohup python3 /srv/indexd/indexd.py {server_mib} {PORT} "
             "> /tmp/indexd.log 2>&1 < /dev/null & echo started"),
    ]
    ready = f"curl -sf http://127.0.0.1:{PORT}/health"

    shared = [
        bash("cd /repo && ls"),
        bash("git log --oneline -3 && git status --short | wc -l"),
        bash("grep -n '^def ' more_itertools/more.py | head -60"),
        # an agent's usual first move: the baseline of the test suite before touching anything
        bash("python3 -m pytest -q -p no:cacheprovider tests/ 2>&1 | tail -3"),
    ]
    if not quick:
        shared += [
            read("/repo/pyproject.toml"),
            bash(f"curl -s http://127.0.0.1:{PORT}/health"),
        ]

    rng = member_rng(seed, "repo")
    combos = list(itertools.product(sorted(TARGETS), PLANS))
    rng.shuffle(combos)
    members = []
    for i in range(group_size):
        fn, plan = combos[i % len(combos)]
        calls, codes = _member(fn, plan, quick, i)
        members.append((list(zip(calls, codes)), {"target": fn, "plan": plan}))
    traces, expect, about = join_members(shared, members)

    params = {
        "workload": "repo",
        "seed": seed,
        "quick": quick,
        "group_size": group_size,
        "source": {"sdist": SDIST[0], "wheels": [r for r, _ in WHEELS],
                   "interpreter": "the rootfs's python3 (Debian 12: 3.11)"},
        "repo_path": "/repo",
        "tests": "more-itertools' own suite (tests/test_more.py, tests/test_recipes.py; 660+ tests)",
        "setup_steps": len(setup),
        "long_lived_process": {"what": "python3 /srv/indexd/indexd.py (HTTP 127.0.0.1:%d): ASTs + "
                               "sources + symbols of /repo then /usr/lib/python3.11" % PORT,
                               "rss_mib": server_mib},
        **about,
        "targets": sorted(TARGETS),
        "plans": list(PLANS),
        "think_s": 0.5 if not quick else 0.2,
        "think_jitter": 0.3,
    }
    task = Task(
        id=f"repo-more-itertools-10.5.0{'-quick' if quick else ''}",
        prompt=("You are in /repo, a checkout of more-itertools 10.5.0 installed in editable mode "
                "with pytest available. A language server answers on "
                f"http://127.0.0.1:{PORT} (/def?name=, /refs?name=). Investigate the helper "
                "assigned to you, improve it or its tests, and keep the test suite passing."),
        setup=tuple(setup),
        ready=ready,
        workdir="/repo",
        max_steps=about["steps_per_trace"]["max"] + 2,
    )
    return Workload(task=task, traces=traces, params=params, expect=expect)
