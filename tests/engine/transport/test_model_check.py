"""Model-check the ring protocol (docs/ring-protocol.md) with spin.

`engine/transport/model/ring.pml` is the Promela model of the protocol.  Each
test generates the verifier (`spin -a`), compiles `pan` with gcc and runs it in
a temporary directory, then parses pan's report:

* safety runs (``-DSAFETY``: assertion violations *and* invalid end states, i.e.
  deadlocks, are both checked) must report ``errors: 0`` after a *complete*
  exhaustive search that stored at least a minimum number of states and
  reached every statement of the model except those of the faults that run
  turns off -- so a broken or vacuous model cannot pass;
* a non-progress-cycle run (``-DNP``, ``pan -l``, no progress labels) must find
  no cycle at all: every execution is finite, so together with "no invalid
  end state" every execution ends with all non-crashed producers flushed;
* mutants (a deliberate protocol bug switched on with ``spin -DBUG_...``) must
  make the verifier report an error, for the expected reason.

The full fault combination (steal + crash + corrupt in one run) is ~79 M states
/ 4 GB, too big for CI, so the faults are checked in pairs (each run also has
arbitrary stalls and a slow application holding a delivered view). Two more runs
check batched delivery (recv_many): runs of verifications that publish CURSOR at
their end, and an application that keeps two views and releases them together;
one of them with the consumer checking record headers only (verify_payload=False).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[3] / "engine" / "transport" / "model" / "ring.pml"
SPIN = shutil.which("spin")

pytestmark = pytest.mark.skipif(SPIN is None, reason="spin (the Promela model checker) is not on PATH")

# pan: -DCOLLAPSE (lossless state compression, not an approximation) keeps the
# biggest runs under ~0.5 GB; -DMEMLIM caps memory at 2 GB so a state-space
# blow-up fails the test instead of the machine.  Search depth -m10000 is far
# above the deepest path (~400); -w24 presizes the hash table (pan grows it).
PAN_CFLAGS = ["-O2", "-w", "-DCOLLAPSE", "-DMEMLIM=2048"]
PAN_ARGS = ["-m10000", "-w24"]
TIMEOUT_S = 300

FAULTS = ("steal", "crash", "corrupt")


@dataclass
class PanReport:
    output: str
    errors: int
    states: int
    unreached: list[int]  # model line numbers pan reports as unreachable

    def __str__(self) -> str:  # shown by pytest when an assertion fails
        return self.output[-4000:]


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 or cmd[0] == "./pan", f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}"
    return out


def verify(workdir: Path, defines: list[str], mode: str = "safety") -> PanReport:
    """spin -a + gcc + ./pan in workdir; mode is 'safety' or 'np' (non-progress cycles)."""
    shutil.copy(MODEL, workdir / "ring.pml")
    _run([SPIN, *defines, "-a", "ring.pml"], workdir)
    mode_flags, run_flags = (["-DSAFETY"], []) if mode == "safety" else (["-DNP"], ["-l"])
    _run(["gcc", *PAN_CFLAGS, *mode_flags, "-o", "pan", "pan.c"], workdir)
    out = _run(["./pan", *PAN_ARGS, *run_flags], workdir)
    errors = re.search(r"errors: (\d+)", out)
    states = re.search(r"(\d+) states, stored", out)
    assert errors and states, f"cannot parse pan's report:\n{out}"
    unreached = []  # only the protocol's processes (not the fault-injecting Crasher, not init)
    for proc, body in re.findall(r"^unreached in proctype (\w+)\n((?:\t.*\n)*)", out, re.M):
        if proc in ("Producer", "Consumer"):
            unreached += [int(n) for n in re.findall(r"ring\.pml:(\d+), state", body)]
    return PanReport(out, int(errors.group(1)), int(states.group(1)), unreached)


@pytest.fixture
def workdir() -> Iterator[Path]:
    # not pytest's tmp_path: concurrent pytest sessions on this host prune each
    # other's old basetemp directories
    with tempfile.TemporaryDirectory(prefix="ring-pml-") as d:
        yield Path(d)


def _marked_lines(tag: str) -> set[int]:
    """Model lines whose comment says 'fault:<tag>' (statements only that fault reaches)."""
    lines = MODEL.read_text().splitlines()
    return {i for i, line in enumerate(lines, 1) if f"fault:{tag}" in line}


def assert_clean_and_complete(report: PanReport, min_states: int, faults_off: set[str]) -> None:
    out = report.output
    assert report.errors == 0, report
    assert "Search not completed" not in out, report
    assert "max search depth too small" not in out, report
    assert "reached -DMEMLIM bound" not in out, report
    assert report.states >= min_states, f"only {report.states} states explored:\n{report}"
    allowed = set().union(*(_marked_lines(f) for f in faults_off))
    unexpected = sorted(set(report.unreached) - allowed)
    assert not unexpected, f"model lines {unexpected} never reached:\n{report}"


BATCH = ["-DMAXBATCH=2", "-DMAXHOLD=2", "-DMAXRUN=2"]

# (spin -D defines, minimum states stored, faults the run turns off).  The
# default bounds are 2 producers x 2 messages (1 and 2 units), 2 slots,
# 3 buffer units; at most 1 steal from a live producer (unbounded from dead
# ones), 1 crash, 1 checksum failure, 1 delivered view held by the app.
# Measured states stored (spin 6.5.2): 7.8 M, 7.2 M, 9.3 M, 2.3 M, 2.8 M, 1.6 M.
SAFETY_RUNS = [
    pytest.param(["-DMAXCORRUPT=0"], 3_000_000, {"corrupt"}, id="2x2-steal-crash"),
    pytest.param(["-DMAXCRASH=0"], 3_000_000, {"crash"}, id="2x2-steal-corrupt"),
    pytest.param(["-DMAXSTEAL=0"], 3_000_000, {"steal"}, id="2x2-crash-corrupt"),
    pytest.param(
        ["-DNPROD=3", "-DNMSG=1", "-DMAXCRASH=0", "-DMAXCORRUPT=0"],
        1_000_000,
        {"crash", "corrupt"},
        id="3x1-steal",
    ),
    pytest.param(
        ["-DNPROD=3", "-DNMSG=1", "-DMAXSTEAL=0", "-DMAXCORRUPT=0"],
        1_000_000,
        {"steal", "corrupt"},
        id="3x1-crash",
    ),
    pytest.param(
        ["-DNSLOT=3", "-DNBUF=4", "-DMAXCRASH=0", "-DMAXCORRUPT=0"],
        700_000,
        {"crash", "corrupt"},
        id="2x2-S3B4-steal",
    ),
    # batches (recv_many): runs of up to 2 verifications publishing CURSOR at their end, 2 views kept
    # and released together. With steals (a quarantined slot inside a batch), the consumer checking
    # headers only: the invariants hold without the payload checksum. Measured: 4.8 M and 5.7 M states.
    pytest.param(
        [*BATCH, "-DHEADER_ONLY", "-DMAXCRASH=0", "-DMAXCORRUPT=0"],
        2_000_000,
        {"crash", "corrupt"},
        id="2x2-batch-steal-header-only",
    ),
    pytest.param([*BATCH, "-DMAXSTEAL=0", "-DMAXCRASH=0"], 2_000_000, {"steal", "crash"}, id="2x2-batch-corrupt"),
]


@pytest.mark.parametrize(("defines", "min_states", "faults_off"), SAFETY_RUNS)
def test_safety_and_no_deadlock(
    workdir: Path, defines: list[str], min_states: int, faults_off: set[str]
) -> None:
    report = verify(workdir, defines)
    assert re.search(r"assertion violations\s+\+", report.output), report
    assert re.search(r"invalid end states\s+\+", report.output), report
    assert_clean_and_complete(report, min_states, faults_off)


def test_no_livelock_cycles(workdir: Path) -> None:
    # No progress labels: any cycle in the state graph is reported.  Measured: 1.2 M states.
    report = verify(workdir, ["-DMAXCRASH=0", "-DMAXCORRUPT=0"], mode="np")
    assert re.search(r"non-progress cycles\s+\+", report.output), report
    assert_clean_and_complete(report, 500_000, {"crash", "corrupt"})


# (mutant defines, regex the first error must match).  Unless they say otherwise
# they run with steal + checksum faults + a held view (no crash); each is
# caught in about a second.
NO_CRASH = ["-DMAXCRASH=0"]
QUARANTINE_MONITOR = r"assertion violated .*stolen_p\[y\]==0"
MUTANTS = [
    # HEAD passes a stolen span whose stalled producer may still write there ...
    pytest.param([*NO_CRASH, "-DBUG_NO_QUARANTINE"], QUARANTINE_MONITOR, id="no-quarantine"),
    # ... and, without the write monitors, its late write corrupts a verified, delivered record
    pytest.param(
        [*NO_CRASH, "-DBUG_NO_QUARANTINE", "-DNO_WRITE_MONITOR"],
        r"assertion violated \(buf\[.*==h?stamp",
        id="no-quarantine-delivery",
    ),
    # the same with the consumer checking headers only: nothing else stands in the way
    pytest.param(
        [*NO_CRASH, "-DHEADER_ONLY", "-DBUG_NO_QUARANTINE", "-DNO_WRITE_MONITOR"],
        r"assertion violated \(buf\[.*==h?stamp",
        id="header-only-no-quarantine-delivery",
    ),
    # a batch released by range (first to last view) frees the quarantined slot between them
    pytest.param(
        [*BATCH, "-DNSLOT=3", "-DNBUF=4", "-DMAXCRASH=0", "-DMAXCORRUPT=0", "-DBUG_BATCH_FREES_RUN"],
        QUARANTINE_MONITOR,
        id="batch-frees-run",
    ),
    # commit by plain store: the fenced producer never acks, HEAD never passes
    pytest.param([*NO_CRASH, "-DBUG_NO_FENCE"], r"invalid end state", id="no-fence"),
    # no per-producer sequence check: duplicates (from go-back-N) are delivered
    pytest.param([*NO_CRASH, "-DBUG_NO_DEDUP"], r"assertion violated .*==dlv\[p\]", id="no-dedup"),
    # no retransmission: a checksum drop is never repaired, the producer never flushes
    pytest.param([*NO_CRASH, "-DBUG_NO_GOBACKN"], r"invalid end state", id="no-go-back-n"),
    # steal a FREE slot only once its span end is known (next W1 or TAIL): two
    # producers dead between [P2] and [P3] leave the consumer waiting forever
    pytest.param(
        [
            "-DBUG_STEAL_FREE_WAITS_FOR_END",
            "-DNPROD=3",
            "-DNMSG=1",
            "-DMAXCRASH=2",
            "-DMAXSTEAL=0",
            "-DMAXCORRUPT=0",
        ],
        r"invalid end state",
        id="steal-free-waits-for-end",
    ),
]


@pytest.mark.parametrize(("defines", "expected"), MUTANTS)
def test_mutant_is_caught(workdir: Path, defines: list[str], expected: str) -> None:
    report = verify(workdir, defines)
    assert report.errors >= 1, f"mutant {defines} not caught:\n{report}"
    first = re.search(r"^pan:1: (.*)$", report.output, re.M)
    assert first and re.search(expected, first.group(1)), report
