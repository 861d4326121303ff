"""bench.front_instructions: a front under callgrind, its counters zeroed after the warm-up and dumped
after the measured requests, for real on 127.0.0.1 (where valgrind is installed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import front_instructions, routers

needs_valgrind = pytest.mark.skipif(
    shutil.which("valgrind") is None or shutil.which("callgrind_control") is None, reason="no valgrind here"
)


def test_a_dumps_total_is_read_off_its_summary_line(tmp_path: Path) -> None:
    dump = tmp_path / "cg.1"
    dump.write_text(
        "# callgrind format\nversion: 1\nevents: Ir\nfl=x\nfn=y\n3 10\nsummary: 123456\ntotals: 123456\n"
    )
    assert front_instructions.dump_total(dump) == 123456
    dump.write_text("# callgrind format\nevents: Ir\n")
    with pytest.raises(ValueError, match="no summary line"):
        front_instructions.dump_total(dump)


def test_bad_counts_and_unknown_fronts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert front_instructions.main(["--requests", "0"]) == 2
    assert "--requests must be at least 1" in capsys.readouterr().err
    if shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None:
        assert front_instructions.main(["--fronts", "fastcore:no-such-mode"]) == 2
        assert "unknown front" in capsys.readouterr().err


def test_a_wrapped_front_runs_on_the_mocks_only(tmp_path: Path) -> None:
    args = routers.build_parser().parse_args(["--workers", "synthetic"])
    with pytest.raises(ValueError, match="on the mocks only"):
        routers.start_front("fastcore:both-gates", 8, args, tmp_path, wrap=lambda argv: argv)


def test_the_table_divides_by_the_floor_measured_at_the_same_point() -> None:
    counts = [
        front_instructions.Count("fastcore:both-gates", 250, False, 16, 10, 0, 200_000.0),
        front_instructions.Count("rawfloor", 250, False, 16, 10, 0, 50_000.0),
        front_instructions.Count("fastcore:both-gates", 250, True, 16, 10, 0, 90_000.0),  # no floor there
    ]
    lines = front_instructions.table(counts).splitlines()
    assert "200.0k" in lines[2] and "4.00x" in lines[2], lines
    assert "1.00x" in lines[3], lines
    assert lines[4].split("|")[-2].strip() == "-", lines


@pytest.mark.slow
@needs_valgrind
def test_the_raw_floor_counted_under_callgrind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "counts.json"
    code = front_instructions.main(
        [
            "--fronts",
            "rawfloor",
            "--requests",
            "12",
            "--warmup",
            "4",
            "--concurrency",
            "2",
            "--output",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr()
    (count,) = json.loads(out.read_text())
    assert count["front"] == "rawfloor" and count["completed"] == 12 and count["errors"] == 0
    # a request through the floor runs tens of thousands of instructions (61.9k at 1 KB here); the
    # warm-up and start-up are not in it, or it would read millions
    assert 10_000 < count["instructions_per_request"] < 1_000_000, count
    assert "| rawfloor" in capsys.readouterr().out


@pytest.mark.slow
@needs_valgrind
def test_the_mooncake_front_counted_under_callgrind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fastcore:mooncake`` (vLLM's MooncakeConnector, both legs at once) is a front here as in
    bench.routers: started on its mocks under callgrind, its requests all answered and counted."""
    out = tmp_path / "counts.json"
    argv = ["--fronts", "fastcore:mooncake", "--requests", "12", "--warmup", "4", "--concurrency", "2"]
    code = front_instructions.main([*argv, "--output", str(out)])
    assert code == 0, capsys.readouterr()
    (count,) = json.loads(out.read_text())
    assert count["front"] == "fastcore:mooncake" and count["completed"] == 12 and count["errors"] == 0
    assert 10_000 < count["instructions_per_request"] < 10_000_000, count
