#!/usr/bin/env python3
"""NIXL's own Python tests and examples, run against NIXL's wheel and against rdma_nixl.

Takes ai-dynamo/nixl's ``test/python`` and ``examples/python`` at a named commit (or as
they are in a local checkout), makes one copy per implementation with only the import
lines changed (``nixl`` -> ``nixl_cu12`` / ``nixl_cu13`` where NIXL's wheel is installed
under that name, ``nixl`` -> ``rdma_nixl`` for ours), runs the same things in each, and
prints one table:

- the pytest suites (``test_nixl_api.py``, ``test_nixl_bindings.py``), test by test;
- the scripts in ``test/python`` (``desc_perf.py``, ``prep_xfer_perf.py list|array``);
- the examples: ``basic_two_peers.py`` and ``expanded_two_peers.py`` (a target and an
  initiator process on 127.0.0.1), ``partial_md_example.py`` (socket exchange; with
  ``--etcd`` only when ``NIXL_ETCD_ENDPOINTS`` is set), ``query_mem_example.py``,
  ``nixl_gds_example.py`` (a temporary file), and ``telemetry_reader.py`` reading the
  ring file an agent of that implementation wrote under ``NIXL_TELEMETRY_DIR``;
- ``python/tests/_nixl_program.py`` (a two-process program importing ``nixl``), run
  unchanged on ours through ``python -m rdma_nixl.as_nixl``, with its READs/s.

``remote_storage_example`` is listed, not run: its client needs VRAM and its server
never exits.

Usage (``tools/peer/nixl-python-tests.sh`` wraps this)::

    nixl_python_tests.py [--nixl-src PATH] [--commit SHA] [--python PY]
                         [--nixl-python PY] [--ours-python PY] [--work DIR]
                         [--nixl-wheel WHEEL|DIR] [--ours-wheel WHEEL|DIR]

``--nixl-src`` is a NIXL checkout (its files as they are, or at ``--commit`` if given),
a bare git directory (at ``--commit``), or a folder holding ``test/python`` and
``examples/python`` as exported (what ``python/gpu-bundle.sh`` puts in its bundle);
without it the sources are cloned from GitHub (``--commit``, default below).
``--python`` is an interpreter with both packages (plus pytest, numpy and torch, which
NIXL's tests import); ``--nixl-python`` / ``--ours-python`` pick one per side instead.
``--nixl-wheel`` / ``--ours-wheel`` install a side's package from a wheel (or the one
wheel of that package in a folder: ``.peer`` from ``tools/peer/fetch-nixl-wheel.sh``,
the bundle's ``wheels``) into a folder of its own under ``--work`` (``pip install
--no-deps --no-index --target``: no network), put first on that side's ``PYTHONPATH``.
On a GPU machine without network: ``bash target/python-gpu/run.sh --nixl-side-by-side``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Tuple

DEFAULT_COMMIT = "8770b655a6b17b5cdf7d2b56b6e0be5392496df5"
REPO_URL = "https://github.com/ai-dynamo/nixl"
ROOT = Path(__file__).resolve().parents[2]
# The repository's layout, or python/gpu-bundle.sh's (tests/ beside tools/).
PROGRAM = next(
    (p for p in (ROOT / "python" / "tests" / "_nixl_program.py", ROOT / "tests" / "_nixl_program.py")
     if p.exists()),
    ROOT / "python" / "tests" / "_nixl_program.py",
)

# An import line of the package `nixl` (not `nixl_storage_utils`, `nixl_cu12`, ...).
IMPORT_LINE = re.compile(r"^(\s*)(from|import)(\s+)nixl(?=[.\s]|$)")


def log(msg: str) -> None:
    print(f"nixl-python-tests: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- sources --------------------------------------------------------------------------------


def is_git_dir(path: Path) -> bool:
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "--git-dir"],
                         capture_output=True, text=True)
    return out.returncode == 0


def fetch_sources(src: Optional[str], commit: Optional[str], dest: Path) -> str:
    """Puts test/python and examples/python under ``dest``; returns what they are."""
    dest.mkdir(parents=True, exist_ok=True)
    paths = ["test/python", "examples/python"]
    if src is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rdma-rs" / "nixl.git"
        if not cache.exists():
            log(f"cloning {REPO_URL} (blobs on demand) into {cache}")
            subprocess.run(["git", "clone", "--bare", "--filter=blob:none", REPO_URL, str(cache)],
                           check=True)
        commit = commit or DEFAULT_COMMIT
        have = subprocess.run(["git", "-C", str(cache), "cat-file", "-e", f"{commit}^{{commit}}"],
                              capture_output=True)
        if have.returncode != 0:
            subprocess.run(["git", "-C", str(cache), "fetch", "origin", commit], check=True)
        src = str(cache)
    root = Path(src)
    if not commit and (root / "SOURCE").is_file() and (root / "test" / "python").is_dir():
        # Exported sources (a bundle's nixl-src, perhaps inside another git work tree):
        # as they are, described by the SOURCE file written with them.
        for p in paths:
            shutil.copytree(root / p, dest / p)
        return f"{root} ({(root / 'SOURCE').read_text().strip()})"
    if commit or not (root / "test" / "python").is_dir():
        if not is_git_dir(root):
            raise SystemExit(f"nixl-python-tests: {root} is not a git repository (for --commit)")
        commit = commit or DEFAULT_COMMIT
        full = subprocess.run(["git", "-C", str(root), "rev-parse", f"{commit}^{{commit}}"],
                              capture_output=True, text=True, check=True).stdout.strip()
        archive = subprocess.run(["git", "-C", str(root), "archive", full, *paths],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return f"ai-dynamo/nixl @ {full[:12]}"
    for p in paths:
        shutil.copytree(root / p, dest / p)
    described = "files as they are"
    if is_git_dir(root):
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        described = f"work tree at {head}"
    return f"{root} ({described})"


def rewrite_imports(tree: Path, package: str) -> int:
    """``nixl`` -> ``package`` on import lines only; returns how many lines changed."""
    changed = 0
    for path in tree.rglob("*.py"):
        lines = path.read_text().splitlines(keepends=True)
        out = []
        for line in lines:
            new = IMPORT_LINE.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}{package}", line)
            if new != line:
                # `import nixl` alone binds the name `nixl`: keep it bound.
                if re.match(r"^\s*import\s+" + re.escape(package) + r"\s*$", new):
                    new = new.rstrip("\n") + " as nixl\n"
                changed += 1
            out.append(new)
        path.write_text("".join(out))
    return changed


# --- implementations --------------------------------------------------------------------------


PROBE = r"""
import importlib, importlib.metadata as md, json, sys
want = sys.argv[1]
names = ["rdma_nixl"] if want == "ours" else ["nixl", "nixl_cu12", "nixl_cu13"]
for name in names:
    try:
        api = importlib.import_module(name + "._api")
    except ImportError:
        continue
    if want != "ours" and api.__name__.startswith("rdma_nixl"):
        continue  # our opt-in `nixl` shim
    dist = {"rdma_nixl": "rdma-nixl", "nixl": "nixl", "nixl_cu12": "nixl-cu12", "nixl_cu13": "nixl-cu13"}[name]
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        version = "?"
    print(json.dumps({"package": name, "version": version}))
    break
else:
    sys.exit(1)
"""


def find_wheel(path: str, key: str) -> Path:
    """The wheel at ``path``, or the one wheel of the side's package in folder ``path``."""
    p = Path(path)
    if p.is_file():
        return p
    prefixes = ("rdma_nixl-",) if key == "ours" else ("nixl-", "nixl_cu12-", "nixl_cu13-")
    found = sorted(w for w in p.glob("*.whl") if w.name.startswith(prefixes))
    if len(found) != 1:
        raise SystemExit(f"nixl-python-tests: want one {'/'.join(prefixes)}*.whl in {p}, found "
                         f"{[w.name for w in found]}")
    return found[0]


def install_wheel(python: str, wheel: Path, site: Path) -> None:
    """Installs ``wheel`` (no dependencies, no index) into folder ``site``."""
    if site.exists():
        shutil.rmtree(site)
    log(f"installing {wheel.name} into {site}")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--no-index", "--no-compile", "--target", str(site), str(wheel)],
                   check=True)


class Side:
    def __init__(self, key: str, python: str, work: Path, site: Optional[Path] = None):
        self.key = key
        self.python = python
        # A folder the side's package was installed into, first on its PYTHONPATH.
        self.site = site
        out = subprocess.run([python, "-c", PROBE, key], capture_output=True, text=True,
                             env=self.env())
        if out.returncode != 0:
            what = "rdma_nixl" if key == "ours" else "NIXL's wheel (nixl, nixl_cu12 or nixl_cu13)"
            raise SystemExit(f"nixl-python-tests: {python} cannot import {what}: {out.stderr.strip()}")
        info = json.loads(out.stdout)
        self.package = info["package"]
        self.version = info["version"]
        self.label = (f"rdma_nixl {self.version}" if key == "ours"
                      else f"NIXL {self.version} ({self.package})")
        self.dir = work / key

    def env(self, **extra) -> dict:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        for name in ("NIXL_TELEMETRY_ENABLE", "NIXL_TELEMETRY_DIR", "NIXL_TELEMETRY_EXPORTER"):
            env.pop(name, None)
        if self.site is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(self.site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(extra)
        return env


# --- runs -------------------------------------------------------------------------------------

Result = Tuple[str, str]  # (status, detail)


def run(cmd: List[str], cwd: Path, env: dict, timeout: float) -> Tuple[int, str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return out.returncode, out.stdout
    except subprocess.TimeoutExpired as e:
        text = e.stdout or b""
        return -1, (text.decode(errors="replace") if isinstance(text, bytes) else text) + "\n[timed out]"


def save(side: "Side", name: str, text: str) -> None:
    logs = side.dir / "logs"
    logs.mkdir(exist_ok=True)
    (logs / (re.sub(r"[^\w.-]+", "_", name) + ".log")).write_text(text)


def judge(codes: List[int], texts: List[str], markers: List[str]) -> Result:
    """Passed when every process printed its marker (the last thing it does) and exited
    with 0 — or was killed by SIGSEGV after printing it: NIXL's wheels crash in a
    library destructor at exit (tools/peer/README.md), after the work, which is shown."""
    done = all(m in t for m, t in zip(markers, texts))
    if done and all(c == 0 for c in codes):
        return ("passed", "")
    if done and all(c in (0, -signal.SIGSEGV) for c in codes):
        return ("passed", "then SIGSEGV at exit")
    worst = next((c for c in codes if c != 0), 0)
    why = next((last_error(t) for m, t in zip(markers, texts) if m not in t), "") or last_error(texts[-1])
    return ("failed", f"exit {worst}: {why}")


def last_error(text: str) -> str:
    """The most telling line of a failure's output."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    for pattern in (r"Error\b|Exception\b", r"error|failed|ERROR", r"."):
        hits = [l for l in lines if re.search(pattern, l)]
        if hits:
            return hits[-1][:160]
    return ""


def pytest_suite(side: Side, files: List[str]) -> Dict[str, Result]:
    tests = side.dir / "test" / "python"
    junit = side.dir / "junit.xml"
    code, text = run(
        [side.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "ignore::pytest.PytestUnknownMarkWarning", f"--junitxml={junit}", "--backend", "UCX", *files],
        tests, side.env(), timeout=1200,
    )
    save(side, "pytest", text)
    results: Dict[str, Result] = {}
    if not junit.exists():
        for f in files:
            results[f"{f} (collection)"] = ("error", last_error(text))
        return results
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        name = f"{module}.py::{case.get('name')}"
        status, detail = "passed", ""
        for child in case:
            if child.tag == "skipped":
                status, detail = "skipped", (child.get("message") or "")[:160]
            elif child.tag in ("failure", "error"):
                status = "failed" if child.tag == "failure" else "error"
                detail = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
        results[name] = (status, detail)
    if code not in (0, 1) and not results:
        results["pytest"] = ("error", last_error(text))
    return results


def script(side: Side, where: str, args: List[str], marker: str, env: Optional[dict] = None,
           timeout: float = 300) -> Result:
    code, text = run([side.python, *args], side.dir / where, env or side.env(), timeout)
    save(side, " ".join(args), text)
    return judge([code], [text], [marker])


def two_peers(side: Side, example: str) -> Result:
    where = side.dir / "examples" / "python"
    port = free_port()
    env = side.env()
    common = [side.python, example, "--ip", "127.0.0.1", "--port", str(port)]
    target = subprocess.Popen(common + ["--mode", "target"], cwd=where, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)  # the target's listener comes up
        code, init_text = run(common + ["--mode", "initiator"], where, env, timeout=180)
        try:
            target_text, _ = target.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            target.kill()
            target_text = target.communicate()[0] + "\n[target timed out]"
        save(side, f"{example} target", target_text)
        save(side, f"{example} initiator", init_text)
        return judge([target.returncode, code], [target_text, init_text],
                     ["Test Complete.", "Test Complete."])
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


TELEMETRY_WRITER = r"""
import sys, time
import numpy as np
from {pkg}._api import nixl_agent
a = nixl_agent("telemetry_writer"); b = nixl_agent("telemetry_peer")
src = np.ones(4096, np.uint8); dst = np.zeros(4096, np.uint8)
a.register_memory([(src.ctypes.data, 4096, 0, "")], "DRAM")
b.register_memory([(dst.ctypes.data, 4096, 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
                      a.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), "telemetry_peer")
state = a.transfer(h)
while state != "DONE":
    state = a.check_xfer_state(h)
time.sleep(0.5)  # NIXL writes its staged events every 100 ms
print("WROTE", flush=True)
"""


def telemetry_reader(side: Side) -> Result:
    where = side.dir / "examples" / "python"
    with tempfile.TemporaryDirectory() as tel:
        env = side.env(NIXL_TELEMETRY_ENABLE="y", NIXL_TELEMETRY_DIR=tel)
        code, text = run([side.python, "-c", TELEMETRY_WRITER.format(pkg=side.package)], where, env, 120)
        save(side, "telemetry writer", text)
        path = Path(tel) / "telemetry_writer"
        wrote = judge([code], [text], ["WROTE"])
        if wrote[0] != "passed" or not path.exists():
            return ("failed", f"writing the ring file: {wrote[1]}")
        reader = subprocess.Popen([side.python, "telemetry_reader.py", "--telemetry_path", str(path)],
                                  cwd=where, env=side.env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        time.sleep(3)
        reader.send_signal(signal.SIGINT)
        try:
            out, _ = reader.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            reader.kill()
            out = reader.communicate()[0]
        save(side, "telemetry_reader", out)
        events = re.findall(r"Event: (\w+)", out)
        if reader.returncode == 0 and "agent_tx_bytes" in events and "agent_memory_registered" in events:
            detail = f"{len(events)} events"
            return ("passed", detail + (f"; writer {wrote[1]}" if wrote[1] else ""))
        return ("failed", f"exit {reader.returncode}, events {events}: {last_error(out)}")


def nixl_program(side: Side) -> Result:
    port = free_port()
    if side.key == "ours":
        prefix = [side.python, "-m", "rdma_nixl.as_nixl", str(PROGRAM)]
        where = ROOT
    else:
        copy = side.dir / "program"
        copy.mkdir(exist_ok=True)
        shutil.copy(PROGRAM, copy / PROGRAM.name)
        if side.package != "nixl":
            rewrite_imports(copy, side.package)
        prefix = [side.python, str(copy / PROGRAM.name)]
        where = copy
    env = side.env()
    target = subprocess.Popen(prefix + ["--mode", "target", "--port", str(port)], cwd=where, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in target.stdout:
            seen.append(line)
            if line.strip() == "READY":
                break
        code, text = run(prefix + ["--mode", "initiator", "--port", str(port), "--iters", "500"],
                         where, env, timeout=300)
        try:
            rest, _ = target.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            target.kill()
            rest = target.communicate()[0] + "\n[target timed out]"
        target_text = "".join(seen) + rest
        save(side, "_nixl_program target", target_text)
        save(side, "_nixl_program initiator", text)
        verdict = judge([target.returncode, code], [target_text, text], ["target done", "RESULT "])
        result = [l for l in text.splitlines() if l.startswith("RESULT ")]
        if verdict[0] == "passed" and result:
            r = json.loads(result[-1][7:])
            rate = f"{r['reads_per_s']:.0f} READs/s ({r['gb_per_s']:.2f} GB/s)"
            return ("passed", rate + (f"; {verdict[1]}" if verdict[1] else ""))
        return verdict
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


def run_side(side: Side) -> Dict[str, Result]:
    log(f"running against {side.label} ({side.python})")
    results = pytest_suite(side, ["test_nixl_api.py", "test_nixl_bindings.py"])
    tests = "test/python"
    examples = "examples/python"
    results["desc_perf.py"] = script(side, tests, ["desc_perf.py"], "Time per desc add")
    for mode in ("list", "array"):
        results[f"prep_xfer_perf.py {mode}"] = script(
            side, tests, ["prep_xfer_perf.py", mode], "make_prepped_xfer:")
    for example in ("basic_two_peers.py", "expanded_two_peers.py"):
        results[example] = two_peers(side, example)
    ports = ["--init-port", str(free_port()), "--target-port", str(free_port())]
    # The example deletes NIXL_ETCD_ENDPOINTS from the environment: it must be set.
    results["partial_md_example.py"] = script(
        side, examples, ["partial_md_example.py", *ports], "Test Complete.",
        env=side.env(NIXL_ETCD_ENDPOINTS=""))
    if os.environ.get("NIXL_ETCD_ENDPOINTS"):
        results["partial_md_example.py --etcd"] = script(
            side, examples, ["partial_md_example.py", "--etcd", *ports], "Test Complete.")
    else:
        results["partial_md_example.py --etcd"] = ("not run", "NIXL_ETCD_ENDPOINTS unset")
    results["query_mem_example.py"] = script(side, examples, ["query_mem_example.py"],
                                             "Example completed successfully!")
    with tempfile.NamedTemporaryFile(prefix="nixl-gds-") as f:
        results["nixl_gds_example.py"] = script(side, examples, ["nixl_gds_example.py", f.name],
                                                "Test Complete.")
    results["telemetry_reader.py (the agent's ring file)"] = telemetry_reader(side)
    results["remote_storage_example"] = ("not run", "its client needs VRAM, its server never exits")
    results["_nixl_program.py (unchanged `import nixl` code)"] = nixl_program(side)
    return results


# --- the table --------------------------------------------------------------------------------


def cell(result: Optional[Result]) -> str:
    if result is None:
        return "-"
    status, detail = result
    if status == "passed" and detail:
        return f"passed, {detail}"
    return status


def print_table(source: str, sides: List[Side], results: List[Dict[str, Result]]) -> None:
    names: List[str] = []
    for r in results:
        for n in r:
            if n not in names:
                names.append(n)
    headers = ["test / example"] + [s.label for s in sides]
    rows = [[n] + [cell(r.get(n)) for r in results] for n in names]
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    print(f"NIXL's Python tests and examples ({source}), import lines changed only")
    print()
    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
    totals = []
    for r in results:
        counts: Dict[str, int] = {}
        for status, _ in r.values():
            counts[status] = counts.get(status, 0) + 1
        totals.append(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    print(line(["total"] + totals))
    notes = []
    for n in names:
        got = [r.get(n) for r in results]
        if len({g[0] if g else None for g in got}) > 1:
            notes.append(f"- {n}: " + "; ".join(
                f"{s.label}: {g[0]}{' (' + g[1] + ')' if g and g[1] else ''}" if g else f"{s.label}: -"
                for s, g in zip(sides, got)))
    if notes:
        print("\nWhere the two differ:")
        print("\n".join(notes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nixl-src", help="a NIXL checkout or git directory (default: clone from GitHub)")
    ap.add_argument("--commit", help=f"the NIXL commit (default {DEFAULT_COMMIT[:12]} when fetching)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with both packages")
    ap.add_argument("--nixl-python", help="interpreter with NIXL's wheel (default: --python)")
    ap.add_argument("--ours-python", help="interpreter with rdma_nixl (default: --python)")
    ap.add_argument("--work", help="keep the copies and logs here (default: a temporary folder)")
    ap.add_argument("--nixl-wheel", help="install NIXL's package from this wheel (or folder holding it)")
    ap.add_argument("--ours-wheel", help="install rdma_nixl from this wheel (or folder holding it)")
    opts = ap.parse_args()

    work = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="nixl-python-tests-"))
    sources = work / "nixl-src"
    if sources.exists():
        shutil.rmtree(sources)
    source = fetch_sources(opts.nixl_src, opts.commit, sources)
    sides = []
    for key, python, wheel in (("nixl", opts.nixl_python or opts.python, opts.nixl_wheel),
                               ("ours", opts.ours_python or opts.python, opts.ours_wheel)):
        site = None
        if wheel:
            site = work / f"site-{key}"
            install_wheel(python, find_wheel(wheel, key), site)
        sides.append(Side(key, python, work, site))
    for side in sides:
        if side.dir.exists():
            shutil.rmtree(side.dir)
        shutil.copytree(sources, side.dir)
        n = rewrite_imports(side.dir, side.package)
        log(f"{side.label}: {n} import lines rewritten to `{side.package}` in {side.dir}")
    results = [run_side(side) for side in sides]
    print_table(source, sides, results)
    if not opts.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
