"""Where a result came from: the code (git commit, dirty tree), the command, the date, the machine and
the package versions. Every results writer (`experiments/common.write_report`, each `paper_repro`
script) stores `provenance()` in its JSON and `provenance_markdown()` at the end of its report, so a
results file says what produced it and whether it is stale.

The code's state (commit, dirty paths) is read once, when this module is first imported: a results
writer imports it when it starts, so the stamp names the code the run loaded, not a commit made
while it ran. Should the code differ from it when the results are written (files other than
experiment outputs that differ from the start commit now but did not then: a commit or an edit
made during the run), `code_changed_during_run` says so and the report names the commit then.

`provenance()` never raises: a fact it cannot find (no git, no /proc/cpuinfo, a package not
installed) is recorded as None.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers")
# What experiments write (their reports, and README's results table built from them): a change there
# does not change what produced a result, so it does not make the tree dirty.
OUTPUT_PATHS = ("results/", "README.md")


def results_dir(quick: bool = False) -> Path:
    """Where results are written: results/ at the repository root; a `--quick` smoke run writes to
    build/results-quick/ instead, so its small-sample numbers never replace the real ones."""
    return ROOT / ("build/results-quick" if quick else "results")


def _from_root(arg: str) -> str:
    """A script named by its path from the repository's root (the command then runs from there,
    wherever it was started); any other argument as it is."""
    path = Path(arg)
    if path.suffix != ".py" or not path.is_file():
        return arg
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:  # a script outside the repository
        return arg


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)  # kB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _accelerator() -> str | None:
    """"<count> x <device kind>" of JAX's devices when this process uses JAX on an accelerator (None on
    CPU, or when it never imported JAX: JAX is not started here for this)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    devices = jax.devices()
    return None if devices[0].platform == "cpu" else f"{len(devices)} x {devices[0].device_kind}"


def _code_state() -> dict:
    """{"commit", "dirty", "dirty_paths"} of the tree now; dirty is True when tracked files other than
    experiment outputs (`OUTPUT_PATHS`: say, the results of an earlier script of the same run) differ
    from the commit (a result may then not be reproducible from `commit` alone; dirty_paths says which)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    if status is not None:
        status = "\n".join(line for line in status.splitlines() if not line[3:].startswith(OUTPUT_PATHS))
    return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "dirty_paths": None if status is None else [line[3:] for line in status.splitlines()]}


CODE_AT_START = _code_state()  # see the module docstring


def provenance() -> dict:
    """{"commit", "dirty", "dirty_paths" (the code when the process started, `CODE_AT_START`),
    "code_changed_during_run", "commit_at_write", "command", "date_utc", "machine": {"cores", "cpu",
    "memory_gib", "platform", "accelerator"}, "versions": {"python", "jax", ...}, "torch_threads"}."""
    now = _code_state()
    changed = _git("diff", "--name-only", CODE_AT_START["commit"]) if CODE_AT_START["commit"] else None
    if changed is not None:
        changed = {path for path in changed.splitlines() if not path.startswith(OUTPUT_PATHS)}
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]  # orig_argv keeps `-m module`
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    return {
        **CODE_AT_START,
        "code_changed_during_run": None if changed is None else changed != set(CODE_AT_START["dirty_paths"] or ()),
        "commit_at_write": now["commit"],
        "command": " ".join(shlex.quote(a) for a in [Path(argv[0]).name, *map(_from_root, argv[1:2]), *argv[2:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": {"cores": cores, "cpu": _cpu_model(), "memory_gib": _memory_gib(),
                    "platform": platform.platform(), "accelerator": _accelerator()},
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
        # torch's intra-op threads when this process imported torch (HF baselines set them to the cores)
        "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    }


def provenance_markdown(prov: dict | None = None) -> str:
    """A "Provenance" section for the end of a markdown report (of `prov`, default: now)."""
    p = prov or provenance()
    m = p["machine"]
    commit = (p["commit"] or "unknown")[:12]
    if p["dirty"]:
        commit += " with uncommitted changes to " + ", ".join(p["dirty_paths"])
    if p.get("code_changed_during_run"):
        commit += f" (the tree changed while it ran: {(p['commit_at_write'] or 'unknown')[:12]} when it was written)"
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    return "\n".join([
        "## Provenance", "",
        f"- commit: {commit}",
        f"- command: `{p['command']}`",
        f"- date: {p['date_utc']}",
        f"- machine: {m['cores']} cores, {m['cpu'] or 'unknown CPU'}, {m['memory_gib']} GiB memory, {m['platform']}"
        + (f", {m['accelerator']}" if m.get("accelerator") else ""),
        f"- versions: {versions}",
        *([f"- torch threads: {p['torch_threads']}"] if p.get("torch_threads") else []),
    ])


def write_results(directory: Path, name: str, markdown: str, data: dict) -> None:
    """Write `directory`/<name>.md (`markdown` followed by the provenance section) and <name>.json
    (`data` with a "provenance" key added), both stamped with one `provenance()`."""
    import json

    prov = provenance()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.md").write_text(markdown.rstrip("\n") + "\n\n" + provenance_markdown(prov) + "\n")
    (directory / f"{name}.json").write_text(json.dumps({**data, "provenance": prov}, indent=2, default=float) + "\n")
