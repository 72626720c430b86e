"""How the benchmark turns several runs of one configuration into the figure it reports."""

from __future__ import annotations

from benchmarks.__main__ import median_run


def run(rate: float, *, once: bool = True, rss: float = 50.0) -> dict[str, object]:
    return {
        "cycles_per_s": rate,
        "completed_exactly_once": once,
        "server_peak_rss_mb": rss,
    }


def test_the_median_run_is_reported_with_every_runs_rate() -> None:
    result = median_run([run(3100.0), run(2700.0), run(2950.0)])
    assert result["cycles_per_s"] == 2950.0
    assert result["rounds_cycles_per_s"] == [3100.0, 2700.0, 2950.0]


def test_an_even_number_of_runs_reports_the_lower_middle_one() -> None:
    assert median_run([run(3000.0), run(2000.0)])["cycles_per_s"] == 2000.0


def test_one_run_that_lost_or_repeated_a_task_marks_the_figure() -> None:
    result = median_run([run(3000.0), run(2900.0, once=False), run(3100.0)])
    assert result["completed_exactly_once"] is False


def test_peak_memory_is_the_highest_of_all_runs() -> None:
    result = median_run([run(3000.0, rss=60.0), run(2900.0, rss=90.0), run(3100.0)])
    assert result["server_peak_rss_mb"] == 90.0
