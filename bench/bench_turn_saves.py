"""A turn's save against the tokens the episode holds so far: time and bytes written per
save, early in long episodes and late in them, side by side in one run (BENCHMARKS.md,
"A turn's save appends its tokens (issue 32 item 3)").

    python bench/bench_turn_saves.py                       # 8 episodes to 32k tokens
    python bench/bench_turn_saves.py --tokens 8192 --quick
    python bench/bench_ab.py --rev <before> bench_turn_saves.py   # before/after

Turn-level recovery saves every running episode after each finished turn, in the rollout
pump's group commit (`pools.put_episodes`). Here `--episodes` episodes of one group, each
adding `--turn-tokens` tokens a turn (a reply then an observation), are saved together in
one transaction per turn (what a group commit does for episodes whose turns finish
together), until each holds `--tokens` tokens. Each save passes `saved_tokens` (what the
attempt's previous save wrote) where the store's code takes it (revision v1_11_a: it
appends the new tokens as a piece); a store before it rewrites the transcript whole.

Measured per transaction: wall time, and the bytes this process handed to write(2)
(`/proc/self/io` wchar: the WAL frames the commit appended, the checkpoints that copy
them into the file). Figures: p50 over the first and the last 10 turns, late / early
(goal: flat, <= 1.2x), and the bytes written over the whole episode against the
transcript's own bytes (8 per token: an int32 id and a float32 logprob).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line, say, write_json  # noqa: E402

from rolloutdb.store import Reservation, Store, pools

WINDOW = 10  # turns averaged at each end
GOAL = 1.2


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def run(work: Path, episodes: int, turn_tokens: int, tokens: int) -> dict:
    appends = "saved_tokens" in pools.EpisodeProgress.__dataclass_fields__
    store = Store.create(work / "episodes.sqlite", replay_capacity=16)
    (g,) = store.reserve([Reservation(0, 0, 0)], num_generations=episodes, target_step=1)
    attempts = store.dispatch([g], policy_version=0)
    reply = turn_tokens * 3 // 4
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    times, written = [], []
    turn = 0
    while len(ids) + turn_tokens <= tokens:
        saved = len(ids)
        turn += 1
        ids += [(turn * 7 + k) % 50_000 for k in range(turn_tokens)]
        logprobs += [-0.1] * reply + [0.0] * (turn_tokens - reply)
        versions += [0] * reply + [-1] * (turn_tokens - reply)
        extra = {"saved_tokens": saved} if appends else {}
        rows = [pools.EpisodeProgress(a, g, i, 0, turn, {"turn": turn}, ids, logprobs, versions, **extra)
                for i, a in enumerate(attempts)]
        w0, t0 = _wchar(), time.perf_counter()
        with store.atomic() as tx:
            pools.put_episodes(tx, rows)
        times.append(time.perf_counter() - t0)
        written.append(_wchar() - w0)
    store.close()
    early, late = slice(0, WINDOW), slice(-WINDOW, None)
    p50 = lambda xs: statistics.median(xs)  # noqa: E731
    out = {
        "appends": appends, "turns": turn, "episodes": episodes, "tokens_per_episode": len(ids),
        "early_ms_p50": p50(times[early]) * 1e3, "late_ms_p50": p50(times[late]) * 1e3,
        "early_bytes_per_save": p50(written[early]) / episodes, "late_bytes_per_save": p50(written[late]) / episodes,
        "bytes_written_over_transcript": sum(written) / (episodes * len(ids) * 8),
    }
    out["late_over_early_ms"] = out["late_ms_p50"] / out["early_ms_p50"]
    out["late_over_early_bytes"] = out["late_bytes_per_save"] / out["early_bytes_per_save"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32_768, help="tokens each episode ends with")
    ap.add_argument("--quick", action="store_true", help="2 episodes to 4096 tokens (a smoke test)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.tokens = 2, 4096
    say(f"# {machine_line()}")
    with tempfile.TemporaryDirectory(prefix="bench_turn_saves_") as tmp:
        r = run(Path(tmp), args.episodes, args.turn_tokens, args.tokens)
    mode = "appended pieces (v1_11_a)" if r["appends"] else "the transcript rewritten whole"
    say(f"{r['episodes']} episodes x {r['turns']} turns of {args.turn_tokens} tokens, to {r['tokens_per_episode']} "
        f"tokens each; saves write {mode}")
    say(f"  a turn's save (all {r['episodes']} episodes, one transaction), p50 of {WINDOW} turns: early "
        f"{r['early_ms_p50']:.2f} ms, late {r['late_ms_p50']:.2f} ms: late/early {r['late_over_early_ms']:.2f}x "
        f"(goal <= {GOAL}x: {'met' if r['late_over_early_ms'] <= GOAL else 'missed'})")
    say(f"  bytes written per episode's save: early {r['early_bytes_per_save']:.0f} B, late "
        f"{r['late_bytes_per_save']:.0f} B: late/early {r['late_over_early_bytes']:.2f}x; over the episode "
        f"{r['bytes_written_over_transcript']:.1f}x the transcript's own bytes")
    write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
