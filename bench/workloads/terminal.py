"""``terminal``: log analysis in a shell with real coreutils, grep, sed, awk and sort.

Setup writes a generator (``/opt/logtools/genlog.py``, stdlib only) and runs it: an nginx
"combined" access log plus the request time as the last field, ``lines`` lines over one day
(29/Nov/2026), seeded, ~135 bytes a line: 2000 client IPs with Zipf-like weights, 12 endpoint
templates (ids, search terms, hashed static assets), status codes by endpoint, two 5xx bursts
from a handful of IPs, log-normal latencies. The file is ``/data/access.log``; a rotated,
gzip-compressed previous day sits next to it (``access.log.1.gz``, a quarter of the size).

Task: find who causes the server errors and which endpoints are slow, and write a report.
Traces: a shared survey prefix (``ls``, ``wc``/``head``, status histogram, hourly histogram),
then per member a question (5xx by client, slow endpoints p95, error bursts per minute,
traffic per endpoint) and a method (awk, a grep|cut|sort|uniq pipeline, or the python tool),
some with a mistake first (an awk syntax error, exit 2; a ``grep -c`` with no match, exit 1)
then the corrected command, and a report written under ``/data/reports``.
"""

from __future__ import annotations


from bunshin.rl import Task

from ._base import Workload, bash, join_members, member_rng, py, read, write

GENLOG = r'''
"""Write a seeded nginx access log (combined format + request time) to stdout."""
import argparse, gzip, random, sys

ap = argparse.ArgumentParser()
ap.add_argument("--lines", type=int, required=True)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--day", default="29/Nov/2026")
a = ap.parse_args()
rng = random.Random(a.seed)
ips = [f"{rng.choice([10, 172, 192, 81, 94, 203])}.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
       for _ in range(2000)]
cum = list(__import__("itertools").accumulate(1.0 / (i + 1) ** 0.9 for i in range(len(ips))))
bad = ips[37:42]
words = "socks lamp chair kettle phone cable desk mug shoes coat book pen".split()
uas = ["Mozilla/5.0 (X11; Linux x86_64) Firefox/133.0", "Mozilla/5.0 (Macintosh) Safari/605.1.15",
       "curl/8.5.0", "python-requests/2.32.3", "Mozilla/5.0 (Windows NT 10.0) Chrome/131.0"]
# (method, template, weight, error rate, median seconds)
EP = [("GET", "/", 10, .001, .004), ("GET", "/login", 3, .002, .02), ("POST", "/login", 2, .01, .09),
      ("GET", "/api/users/{id}", 12, .004, .03), ("GET", "/api/orders/{id}", 9, .03, .08),
      ("POST", "/api/orders", 3, .02, .25), ("GET", "/api/search?q={w}", 8, .01, .18),
      ("GET", "/api/cart", 6, .003, .02), ("PUT", "/api/cart", 2, .006, .04),
      ("GET", "/static/app.{h}.js", 14, 0, .002), ("GET", "/static/style.{h}.css", 10, 0, .002),
      ("GET", "/health", 5, 0, .001)]
epw = list(__import__("itertools").accumulate(e[2] for e in EP))
bursts = [(rng.randrange(0, 86400 - 600), 300) for _ in range(2)]
step = 86400 / a.lines
out = sys.stdout
for n in range(a.lines):
    t = int(n * step)
    hh, mm, ss = t // 3600, t // 60 % 60, t % 60
    in_burst = any(b <= t < b + d for b, d in bursts)
    ip = rng.choice(bad) if in_burst and rng.random() < .3 else rng.choices(ips, cum_weights=cum)[0]
    m, tpl, _, err, med = rng.choices(EP, cum_weights=epw)[0]
    path = tpl.format(id=rng.randrange(1, 50000), w=rng.choice(words), h="3f9a1c")
    r = rng.random()
    if (in_burst and ip in bad and tpl.startswith("/api")) or r < err:
        status = rng.choice([500, 502, 503, 504])
    elif tpl.startswith("/static") and r < .4:
        status = 304
    elif "{id}" in tpl and r < .06:
        status = 404
    elif m == "POST" and r < .05:
        status = rng.choice([400, 401, 422])
    else:
        status = 201 if m == "POST" else 200
    size = 0 if status == 304 else int(rng.lognormvariate(7, 1.2))
    rt = rng.lognormvariate(0, .6) * med * (8 if status >= 500 else 1)
    out.write(f'{ip} - - [{a.day}:{hh:02d}:{mm:02d}:{ss:02d} +0000] "{m} {path} HTTP/1.1" {status} {size} '
              f'"-" "{rng.choice(uas)}" {rt:.3f}\n')
'''

STATUS_HIST = "awk '{print $9}' access.log | sort | uniq -c | sort -rn"

# question -> method -> steps; a step is (call, expected exit code)
def _questions(i: int, quick: bool) -> dict[str, dict[str, list]]:
    rep = f"/data/reports/member{i}.txt"
    norm = "sed -E 's#/[0-9]+#/:id#g; s#\\?q=[a-z]+#?q=:q#; s#\\.[0-9a-f]{6}\\.#.:hash.#'"
    ok = f"test -s {rep}"
    return {
        "errors_by_client": {
            "awk": [
                (bash("awk '$9 >= 500 {c[$1]++} END {for (ip in c) print c[ip], ip' access.log > /tmp/errors_by_ip.txt"), 2),
                (bash("awk '$9 >= 500 {c[$1]++} END {for (ip in c) print c[ip], ip}' access.log > /tmp/errors_by_ip.txt "
                      "&& sort -rn /tmp/errors_by_ip.txt | head"), 0),
                (bash(f"sort -rn /tmp/errors_by_ip.txt | head -5 > {rep} && {ok} && cat {rep}"), 0),
            ],
            "pipeline": [
                (bash("grep -c '\" 5[0-9][0-9] ' access.log"), 0),
                (bash("grep '\" 5[0-9][0-9] ' access.log | cut -d' ' -f1 | sort | uniq -c | sort -rn | head"), 0),
                (bash(f"grep '\" 5[0-9][0-9] ' access.log | cut -d' ' -f1 | sort | uniq -c | sort -rn | head -5 > {rep} "
                      f"&& {ok} && cat {rep}"), 0),
            ],
            "python": [
                (py("import collections\nc = collections.Counter(l.split()[0] for l in open('/data/access.log') "
                    "if l.split()[8].startswith('5'))\nprint(c.most_common(10))"), 0),
                (bash("grep -c '\" 505 ' access.log"), 1),
                (bash(f"awk '$9 >= 500' access.log | awk '{{print $1}}' | sort | uniq -c | sort -rn | head -5 "
                      f"| tee {rep} && {ok}"), 0),
            ],
        },
        "slow_endpoints": {
            "awk": [
                (bash(f"awk '{{print $6, $7, $NF}}' access.log | {norm} | awk '{{s[$1\" \"$2]+=$3; n[$1\" \"$2]++}} END "
                      "{for (k in s) printf \"%.4f %7d %s\\n\", s[k]/n[k], n[k], k}' | sort -rn"), 0),
                (bash(f"awk '{{print $7, $NF}}' access.log | {norm} | sort -k1,1 -k2,2n | awk '{{k = $1; v[k, ++n[k]] = $2}} "
                      "END {for (k in n) print v[k, int(n[k] * 0.95)], n[k], k}' "
                      f"| sort -rn | head -5 | tee {rep} && {ok}"), 0),
            ],
            "python": [
                (py("import collections, re, statistics\nd = collections.defaultdict(list)\n"
                    "for l in open('/data/access.log'):\n    f = l.split()\n"
                    "    d[re.sub(r'/\\d+', '/:id', f[6].split('?')[0])].append(float(f[-1]))\n"
                    "for k, v in sorted(d.items(), key=lambda kv: -statistics.quantiles(kv[1], n=20)[-1])[:8]:\n"
                    "    print(f'{statistics.quantiles(v, n=20)[-1]:.3f} {len(v):7d} {k}')"), 0),
                (bash(f"awk '$NF > 1' access.log | {norm} | awk '{{print $6, $7}}' | sort | uniq -c | sort -rn | head -5 "
                      f"| tee {rep} && {ok}"), 0),
            ],
        },
        "error_bursts": {
            "awk": [
                (bash("awk '$9 >= 500 {print substr($4, 14, 5)}' access.log | uniq -c | sort -rn | head"), 0),
                (bash("awk '$9 >= 500 {print substr($4, 14, 4)}' access.log | uniq -c | awk '$1 > 20' | head -20"), 0),
                (bash(f"awk '$9 >= 500 {{print substr($4, 14, 5)}}' access.log | uniq -c | sort -rn | head -3 > {rep} "
                      f"&& {ok} && cat {rep}"), 0),
            ],
            "pipeline": [
                (bash("grep -E '\" 50[0-4] ' access.log | cut -d: -f2,3 | uniq -c | sort -rn | head"), 0),
                (bash("grep -E '\" 50[0-4] ' access.log | cut -d: -f2,3 | uniq -c | sort -rn | head -1 | awk '{print $2}' "
                      "> /tmp/peak && grep -F \":$(cat /tmp/peak):\" access.log | awk '$9 >= 500 {print $1}' | sort | uniq -c "
                      "| sort -rn | head -5"), 0),
                (bash(f"{{ echo peak minute: $(cat /tmp/peak); grep -cF \":$(cat /tmp/peak):\" access.log; }} | tee {rep} "
                      f"&& {ok}"), 0),
            ],
        },
        "traffic": {
            "awk": [
                (bash(f"awk '{{print $7, $10}}' access.log | {norm} | awk '{{b[$1]+=$2; n[$1]++}} END "
                      "{for (k in b) printf \"%12d %8d %s\\n\", b[k], n[k], k}' | sort -rn"), 0),
                (bash("cut -d'\"' -f6 access.log | sort | uniq -c | sort -rn"), 0),
                (bash(f"awk '{{print $7}}' access.log | {norm} | sort | uniq -c | sort -rn | head -5 | tee {rep} && {ok}"), 0),
            ],
            "python": [
                (py("import collections\nc = collections.Counter(l.split('\"')[1].split()[0] for l in open('/data/access.log'))\n"
                    "print(c)"), 0),
                (bash("zcat access.log.1.gz | wc -l && zcat access.log.1.gz | awk '{print $9}' | sort | uniq -c | sort -rn | head -4"), 0),
                (bash(f"awk '{{print $6}}' access.log | tr -d '\"' | sort | uniq -c | sort -rn | tee {rep} && {ok}"), 0),
            ],
        },
    }


def make(group_size: int, seed: int = 0, quick: bool = False) -> Workload:
    """The ``terminal`` workload for ``group_size`` members (see the module docstring)."""
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    lines = 40_000 if quick else 400_000
    setup = (
        write("/opt/logtools/genlog.py", GENLOG.lstrip()),
        bash(f"mkdir -p /data/reports && cd /data && python3 /opt/logtools/genlog.py --lines {lines} "
             f"--seed {seed} > access.log && python3 /opt/logtools/genlog.py --lines {lines // 4} "
             f"--seed {seed + 1} --day 28/Nov/2026 | gzip -1 > access.log.1.gz && ls -l /data"),
    )
    shared = [
        bash("cd /data && ls -lh"),
        bash("wc -l access.log && head -3 access.log"),
        bash(STATUS_HIST),
    ]
    if not quick:
        shared += [
            bash("cut -d: -f2 access.log | uniq -c"),
            read("/opt/logtools/genlog.py"),
        ]
    rng = member_rng(seed, "terminal")
    qs0 = _questions(0, quick)
    combos = [(q, m) for q in sorted(qs0) for m in sorted(qs0[q])]
    rng.shuffle(combos)
    members = []
    for i in range(group_size):
        q, m = combos[i % len(combos)]
        steps = list(_questions(i, quick)[q][m])
        if quick:
            steps = steps[-2:]
        else:
            # a second look: the full method's steps, then a check of the report
            steps.append((bash(f"wc -l /data/reports/member{i}.txt && ls -l /data/reports"), 0))
            steps.append((bash(f"tail -n {3 + i % 5} access.log | awk '{{print $1, $9, $NF}}'"), 0))
        members.append((steps, {"question": q, "method": m}))
    traces, expect, about = join_members(shared, members)
    params = {
        "workload": "terminal",
        "seed": seed,
        "quick": quick,
        "group_size": group_size,
        "source": {"tools": "the rootfs's coreutils, grep, sed, gawk/mawk, gzip, python3 (Debian 12)",
                   "data": "generated by /opt/logtools/genlog.py (stdlib, seeded)"},
        "log_lines": lines,
        "log_bytes_approx": lines * 135,
        "rotated_log_lines": lines // 4,
        "setup_steps": len(setup),
        "long_lived_process": None,
        **about,
        "questions": sorted(qs0),
        "think_s": 0.5 if not quick else 0.2,
        "think_jitter": 0.3,
    }
    task = Task(
        id=f"terminal-access-log-{lines}-s{seed}",
        prompt=("/data/access.log is today's nginx access log (combined format, request time in "
                "seconds as the last field). Find which clients cause the 5xx errors, when they "
                "happen and which endpoints are slow; write your findings to /data/reports/."),
        setup=setup,
        ready="test -s /data/access.log && test -d /data/reports",
        workdir="/data",
        max_steps=about["steps_per_trace"]["max"] + 2,
    )
    return Workload(task=task, traces=traces, params=params, expect=expect)
