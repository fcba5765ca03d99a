"""``server``: an agent operating a live Redis holding an application's data.

Setup writes a seeded loader (``/srv/app/load_redis.py``, stdlib only), starts the rootfs's
``redis-server`` (Debian 12: 7.0) on 127.0.0.1:6379 with persistence off (``--save ''
--appendonly no``), and pipes the loader's RESP protocol into ``redis-cli --pipe``:

* ``users`` hashes ``user:<id>`` (name, email, country, plan, created, visits, last_ip),
* one session string ``session:<hex>`` -> id with a TTL of 1-48 h for 60% of the users,
* a sorted set ``leaderboard`` (every user with a score), sets ``country:<cc>`` and
  ``plan:<plan>`` of user ids, lists ``events:<cc>`` of JSON events (half the users, capped
  at 2000 per list), and ``meta:users`` / ``meta:loaded``.

``ready`` checks ``meta:loaded``. Traces: a shared survey prefix (ping/INFO, DBSIZE and memory,
a SCAN sample, one user, the top of the leaderboard), then per member one read-side
investigation (inspect a user, sessions and their TTLs, a hand-written Python RESP client
sampling plans, a Lua script over the top 100) and one write-side change (update a user and
its rank, a mistaken command answered by WRONGTYPE then the right one, expiring a batch of
sessions), on a user id drawn from the seed.
"""

from __future__ import annotations

import itertools

from bunshin.rl import Task

from ._base import Workload, bash, join_members, member_rng, py, write

LOADER = r'''
"""Print RESP commands that load a seeded application dataset into Redis."""
import json, random, sys

users, seed = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
out = sys.stdout.buffer
first = "ana ben chen dara eli fatima goro hana ivan jun kofi lena mateo nora omar pia rui sara tomas yuki".split()
last = "smith garcia kim müller rossi sato silva novak dubois khan lee martin".split()
countries = ["US", "DE", "JP", "BR", "IN", "FR", "GB", "NG", "KR", "MX"]
plans = ["free"] * 7 + ["pro"] * 2 + ["team"]
kinds = ["login", "view", "search", "purchase", "logout"]


def cmd(*args):
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    out.write(b"".join(parts))


events = {c: 0 for c in countries}
for uid in range(1, users + 1):
    name = f"{rng.choice(first)} {rng.choice(last)}"
    cc, plan = rng.choice(countries), rng.choice(plans)
    cmd("HSET", f"user:{uid}", "name", name, "email", f"{name.replace(' ', '.')}{uid}@example.com",
        "country", cc, "plan", plan, "created", 1700000000 + rng.randrange(30000000),
        "visits", rng.randrange(1, 500), "last_ip", f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}")
    cmd("ZADD", "leaderboard", rng.randrange(100000), f"user:{uid}")
    cmd("SADD", f"country:{cc}", uid)
    cmd("SADD", f"plan:{plan}", uid)
    if rng.random() < 0.6:
        cmd("SET", "session:%032x" % rng.getrandbits(128), uid, "EX", rng.randrange(3600, 48 * 3600))
    if rng.random() < 0.5 and events[cc] < 2000:
        events[cc] += 1
        cmd("RPUSH", f"events:{cc}", json.dumps({"user": uid, "kind": rng.choice(kinds),
                                                 "ts": 1764374400 + rng.randrange(86400)}))
cmd("SET", "meta:users", users)
cmd("SET", "meta:loaded", 1)
'''

RESP_CLIENT = r'''
import collections, random, socket

def resp(*args):
    return b"".join([b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a) for a in (str(x).encode() for x in args)])

def read_reply(f):
    line = f.readline()
    t, rest = line[:1], line[1:-2]
    if t == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2].decode()
    if t == b"*":
        return [read_reply(f) for _ in range(int(rest))]
    if t == b"-":
        raise RuntimeError(rest.decode())
    return int(rest) if t == b":" else rest.decode()

s = socket.create_connection(("127.0.0.1", 6379))
f = s.makefile("rb")
s.sendall(resp("GET", "meta:users"))
n = int(read_reply(f))
ids = random.Random(SEED).sample(range(1, n + 1), min(SAMPLE, n))
s.sendall(b"".join(resp("HMGET", f"user:{i}", "plan", "country") for i in ids))
rows = [read_reply(f) for _ in ids]
print("sampled", len(rows), "of", n, "users")
print("plans:", collections.Counter(r[0] for r in rows).most_common())
print("countries:", collections.Counter(r[1] for r in rows).most_common(5))
'''


def _read_side(kind: str, uid: int, i: int, quick: bool) -> list:
    if kind == "inspect":
        steps = [(bash(f"redis-cli hgetall user:{uid}"), 0),
                 (bash(f"redis-cli zscore leaderboard user:{uid} && redis-cli zrevrank leaderboard user:{uid}"), 0)]
        if not quick:
            steps += [(bash(f"cc=$(redis-cli hget user:{uid} country); echo $cc; redis-cli scard country:$cc "
                            "&& redis-cli lrange events:$cc 0 4"), 0),
                      (bash(f"redis-cli sismember plan:$(redis-cli hget user:{uid} plan) {uid}"), 0)]
        return steps
    if kind == "sessions":
        steps = [(bash("redis-cli --scan --pattern 'session:*' | head -3 | "
                       "while read k; do echo \"$k $(redis-cli get $k) ttl=$(redis-cli ttl $k)\"; done"), 0),
                 (bash("redis-cli --scan --pattern 'session:*' | wc -l"), 0)]
        if not quick:
            steps += [(bash("redis-cli info keyspace"), 0),
                      (bash("redis-cli --bigkeys -i 0 2>&1 | tail -12"), 0)]
        return steps
    if kind == "python":
        steps = [(write(f"/srv/app/sample_{i}.py", RESP_CLIENT.lstrip().replace("SEED", str(uid))
                        .replace("SAMPLE", "2000" if not quick else "500")), 0),
                 (bash(f"python3 /srv/app/sample_{i}.py"), 0)]
        if not quick:
            steps += [(py("import socket; s = socket.create_connection(('127.0.0.1', 6379)); "
                          "s.sendall(b'INFO stats\\r\\n'); print(s.recv(65536).decode()[:600])"), 0),
                      (bash("redis-cli scard plan:pro && redis-cli scard plan:team && redis-cli scard plan:free"), 0)]
        return steps
    if kind == "lua":
        lua = ("local n = 0 for _, k in ipairs(redis.call('zrevrange', KEYS[1], 0, 99)) do "
               "if redis.call('hget', k, 'plan') ~= 'free' then n = n + 1 end end return n")
        steps = [(bash(f"redis-cli eval \"{lua}\" 1 leaderboard"), 0),
                 (bash("redis-cli zcount leaderboard 90000 +inf"), 0)]
        if not quick:
            steps += [(bash("redis-cli zrevrange leaderboard 0 2 | xargs -I{} redis-cli hmget {} name plan"), 0),
                      (bash("redis-cli slowlog get 3 | head -20; redis-cli config get maxmemory*"), 0)]
        return steps
    raise ValueError(kind)


def _write_side(kind: str, uid: int, i: int, quick: bool) -> list:
    if kind == "update":
        steps = [(bash(f"old=$(redis-cli hget user:{uid} plan) && redis-cli hincrby user:{uid} visits 1 "
                       f"&& redis-cli hset user:{uid} plan pro && redis-cli smove plan:$old plan:pro {uid}"), 0),
                 (bash(f"redis-cli zincrby leaderboard 2500 user:{uid} && redis-cli zrevrank leaderboard user:{uid}"), 0)]
        if not quick:
            steps += [(bash(f"redis-cli hmget user:{uid} plan visits"), 0)]
        return steps
    if kind == "mistake":
        # -e: redis-cli exits 1 on an error reply (WRONGTYPE: the leaderboard is a sorted set)
        steps = [(bash(f"redis-cli -e lpush leaderboard user:{uid}"), 1),
                 (bash(f"redis-cli type leaderboard && redis-cli zadd leaderboard 1 user:{uid}-{i}"), 0)]
        if not quick:
            steps += [(bash(f"redis-cli zrem leaderboard user:{uid}-{i} && redis-cli zcard leaderboard"), 0)]
        return steps
    if kind == "expire":
        steps = [(bash("redis-cli --scan --pattern 'session:*' | head -200 > /tmp/expired_sessions "
                       "&& xargs redis-cli del < /tmp/expired_sessions"), 0),
                 (bash("redis-cli dbsize"), 0)]
        if not quick:
            steps += [(bash("redis-cli info memory | grep -E '^used_memory(_human|_peak_human):'"), 0)]
        return steps
    raise ValueError(kind)


READS = ("inspect", "sessions", "python", "lua")
WRITES = ("update", "mistake", "expire")


def make(group_size: int, seed: int = 0, quick: bool = False) -> Workload:
    """The ``server`` workload for ``group_size`` members (see the module docstring)."""
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    users = 20_000 if quick else 200_000
    setup = (
        write("/srv/app/load_redis.py", LOADER.lstrip()),
        bash("redis-server --port 6379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes "
             "--logfile /tmp/redis.log --dir /tmp && for _ in $(seq 200); do redis-cli ping 2>/dev/null "
             "| grep -q PONG && break; sleep 0.05; done; redis-cli ping"),
        bash(f"python3 /srv/app/load_redis.py {users} {seed} | redis-cli --pipe"),
    )
    shared = [
        bash("redis-cli ping && redis-cli info server | grep -E '^(redis_version|tcp_port|uptime_in_seconds):'"),
        bash("redis-cli dbsize && redis-cli info memory | grep -E '^used_memory(_human|_peak_human):'"),
        bash("redis-cli --scan --pattern 'user:*' | head -5"),
    ]
    if not quick:
        shared += [
            bash("redis-cli hgetall user:42"),
            bash("redis-cli zrevrange leaderboard 0 9 withscores"),
        ]
    rng = member_rng(seed, "server")
    combos = list(itertools.product(READS, WRITES))
    rng.shuffle(combos)
    members = []
    for i in range(group_size):
        r, w = combos[i % len(combos)]
        uid = rng.randrange(1, users + 1)
        steps = _read_side(r, uid, i, quick) + _write_side(w, uid, i, quick)
        members.append((steps, {"read": r, "write": w, "user": uid}))
    traces, expect, about = join_members(shared, members)
    params = {
        "workload": "server",
        "seed": seed,
        "quick": quick,
        "group_size": group_size,
        "source": {"server": "the rootfs's redis-server/redis-cli (Debian 12: 7.0.15)",
                   "data": "generated by /srv/app/load_redis.py (stdlib, seeded)"},
        "users": users,
        "keys_approx": int(users * 2.6) + 30,
        "long_lived_process": {"what": "redis-server 127.0.0.1:6379, persistence off",
                               "used_memory_mib_approx": round(users * 0.000545, 1)},
        "setup_steps": len(setup),
        **about,
        "think_s": 0.5 if not quick else 0.2,
        "think_jitter": 0.3,
    }
    task = Task(
        id=f"server-redis-{users}-s{seed}",
        prompt=("A Redis server on 127.0.0.1:6379 holds the application's users (hashes user:<id>), "
                "sessions, a leaderboard, per-country sets and event lists. Investigate the "
                "account you are given and apply the requested change without harming other data."),
        setup=setup,
        ready="test \"$(redis-cli get meta:loaded)\" = 1",
        workdir="/srv/app",
        max_steps=about["steps_per_trace"]["max"] + 2,
    )
    return Workload(task=task, traces=traces, params=params, expect=expect)
