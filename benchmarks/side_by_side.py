"""Before / after: the same benchmark scripts run against two versions of tutel-jax, interleaved, in one run.

    python benchmarks/side_by_side.py --base <git ref> [--rounds 2] [--only moe_layer dropless ...] [--quick]
        [--out benchmarks/results/side_by_side_cpu.json]

The base version is `git archive <ref>` unpacked into a temporary folder, with this checkout's `benchmarks/` in
place of its own (the same measuring code on both sides); the other side is this checkout. Each round runs every
selected benchmark script once per side, each in its own process with the same environment (`PYTHONPATH` = that
side's tree, the benchmark's own allocator setting), and alternates which side goes first (base, head in even
rounds; head, base in odd ones), so that a slow drift of a shared machine hits both alike.

A benchmark's measurements are the `median_s` leaves of its JSON (`common.Timing`); for each one the report gives
the median over rounds of each side, head / base, and the spread of each side over rounds (max / min of its round
medians), which is the noise a difference has to exceed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt_ratio, markdown_table, repo_root, write_json, write_text  # noqa: E402

#: benchmark script -> (extra arguments, JSON paths left out as repeats of another leaf)
BENCHMARKS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    # the one-hot dispatch reference is benchmark code, not library code: left out (it is most of the run time)
    "moe_layer": (["--no-onehot"], ()),
    "dropless": ([], ()),
    "expert_parallel": ([], ()),
    # tutel-jax alone (HF's side does not change between versions); `systems` holds every tutel-jax variant
    "generate": (["--no-hf"], (".tutel.", ".tutel_by_impl.")),
}
DEFAULT_OUT = repo_root() / "benchmarks/results/side_by_side_cpu.json"


def median_leaves(data: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(path, seconds) for every `median_s` leaf of a benchmark's JSON, paths like `.timings.EP 8 (flat)`."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key == "median_s" and isinstance(value, (int, float)):
                yield path, float(value)
            else:
                yield from median_leaves(value, f"{path}.{key}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from median_leaves(value, f"{path}[{_label(value, i)}]")


def _label(item: Any, index: int) -> str:
    """A list item's name in a path: its identifying fields (batch, experts, k, ...) when it has them."""
    if isinstance(item, dict):
        keys = [k for k in ("batch", "num_experts", "top_k", "experts", "k", "name") if k in item
                and isinstance(item[k], (int, float, str))]
        if keys:
            return ",".join(f"{k}={item[k]}" for k in keys)
    return str(index)


def unpack_base(ref: str, into: Path) -> str:
    """Unpacks `git archive ref` into `into`; returns the full commit hash."""
    root = repo_root()
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--base: {ref!r} is not a commit of this repository")
    archive = subprocess.Popen(["git", "-C", str(root), "archive", commit.stdout.strip()], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {ref} failed")
    return commit.stdout.strip()


def run_once(tree: Path, name: str, args: list[str], out: Path, quick: bool) -> float:
    """Runs `tree/benchmarks/<name>.py` in a fresh process with tree's library; returns its wall time."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "benchmarks" / f"{name}.py"), *args, "--out", str(out)]
    if quick:
        cmd.append("--quick")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} ({tree}) failed with exit {done.returncode}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def library_file(tree: Path) -> str:
    """Where `import tutel_jax` resolves with PYTHONPATH=tree (checks that each side runs its own library)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", "import tutel_jax; print(tutel_jax.__file__)"], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def summarize(runs: dict[str, list[dict[str, float]]], skip: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per measurement: each side's median over rounds, head / base and each side's spread over rounds."""
    rows = []
    for path in runs["base"][0]:
        if any(s in path for s in skip) or not all(path in r for side in runs.values() for r in side):
            continue
        sides = {side: [r[path] for r in rounds] for side, rounds in runs.items()}
        base, head = (statistics.median(sides[s]) for s in ("base", "head"))
        rows.append({"measurement": path.lstrip("."), "base_s": base, "head_s": head, "head_over_base": head / base,
                     "base_spread": max(sides["base"]) / min(sides["base"]),
                     "head_spread": max(sides["head"]) / min(sides["head"]), "rounds": sides})
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Measured on {report['machine']}, {report['date']}. Base `{report['base'][:10]}` against head "
             f"`{report['head'][:10]}`{' (quick sizes)' if report['quick'] else ''}: each benchmark script run "
             f"{report['rounds']} times per side, alternating which side goes first. Times are the median over "
             "rounds of each run's median; spread = max / min of a side's round medians (the noise).", ""]
    for name, bench in report["benchmarks"].items():
        ratios = [r["head_over_base"] for r in bench["rows"]]
        lines += [f"**{name}** ({len(ratios)} measurements; head / base: median {fmt_ratio(statistics.median(ratios))}, "
                  f"min {fmt_ratio(min(ratios))}, max {fmt_ratio(max(ratios))})", ""]
        table = [[r["measurement"], f"{r['base_s'] * 1e3:.3g}", f"{r['head_s'] * 1e3:.3g}",
                  f"**{r['head_over_base']:.2f}**", f"{r['base_spread']:.2f}", f"{r['head_spread']:.2f}"]
                 for r in bench["rows"]]
        lines += [markdown_table(["measurement", "base ms", "head ms", "head / base", "base spread", "head spread"],
                                 table, align="lrrrrr"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git ref of the version to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each benchmark per side (default 2)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="the benchmarks' --quick sizes (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output; .md next to it")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    head_tree = repo_root()
    head = subprocess.run(["git", "-C", str(head_tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(head_tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="tutel_jax_base_") as tmp:
        base_tree = Path(tmp) / "base"
        base_tree.mkdir()
        base = unpack_base(args.base, base_tree)
        shutil.rmtree(base_tree / "benchmarks", ignore_errors=True)
        shutil.copytree(head_tree / "benchmarks", base_tree / "benchmarks",
                        ignore=shutil.ignore_patterns("results", "__pycache__"))
        trees = {"base": base_tree, "head": head_tree}
        for side, tree in trees.items():
            found = Path(library_file(tree)).resolve()
            if not found.is_relative_to(tree.resolve()):
                raise SystemExit(f"{side}: tutel_jax imports from {found}, not from {tree}")
        report: dict[str, Any] = {"base": base, "head": head.stdout.strip() + (" (with local changes)" if dirty else ""),
                                  "rounds": args.rounds, "quick": args.quick, "benchmarks": {}}
        runs = {name: {"base": [], "head": []} for name in args.only}
        wall = {name: {"base": [], "head": []} for name in args.only}
        machine = None
        for r in range(args.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for name in args.only:
                for side in order:
                    out = Path(tmp) / f"{name}-{side}-{r}.json"
                    print(f"round {r + 1}/{args.rounds}: {name} ({side})", flush=True)
                    wall[name][side].append(run_once(trees[side], name, BENCHMARKS[name][0], out, args.quick))
                    data = json.loads(out.read_text())
                    machine = machine or data.get("machine")
                    runs[name][side].append(dict(median_leaves(data)))
        for name in args.only:
            report["benchmarks"][name] = {"rows": summarize(runs[name], BENCHMARKS[name][1]),
                                          "script_wall_s": wall[name]}
    info = machine or {}
    report["machine"] = f"{info.get('backend', '?')} ({info.get('cpu_count', '?')} CPUs), jax {info.get('jax_version', '?')}"
    report["date"] = info.get("date", "")
    write_json(args.out, report)
    write_text(args.out.with_suffix(".md"), markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
