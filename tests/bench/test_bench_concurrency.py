"""bench.concurrency's verdicts: ratios pair each method's point with plain's of the same
repeat and number of clients, the verdict goes by their median, and plain against vLLM by
the medians of each side."""

from __future__ import annotations

from bench.concurrency import Point, against_vllm, comparison_table, never_slower, speedups


def point(method: str, clients: int, repeat: int, rate: float, server: str = "specgate") -> Point:
    return Point(server, method, clients, repeat, 4, rate, rate, 1.0, 1.0, 0.1, 0.1)


def test_ratios_pair_points_of_one_repeat_and_the_verdict_takes_their_median() -> None:
    points = [
        point("none", 4, 0, 40.0),
        point("draft", 4, 0, 44.0),  # 1.1x
        point("none", 4, 1, 20.0),  # the load rose: both sides of this repeat's ratio slow
        point("draft", 4, 1, 18.0),  # 0.9x
        point("none", 4, 2, 40.0),
        point("draft", 4, 2, 48.0),  # 1.2x
        point("none", 8, 0, 60.0),
        point("draft", 8, 0, 57.0),  # 0.95x, the only repeat at 8
    ]
    ratios = speedups(points)
    assert ratios["draft"][4].ratios == [1.1, 0.9, 1.2]
    assert ratios["draft"][4].median == 1.1
    verdict = never_slower(ratios)["draft"]
    assert verdict == {"never_slower": False, "slowest_clients": 8, "slowest_median_ratio": 0.95}
    points[-1] = point("draft", 8, 0, 66.0)
    assert never_slower(speedups(points))["draft"]["never_slower"] is True


def test_plain_against_vllm_compares_medians_per_number_of_clients() -> None:
    ours = [point("none", 4, r, rate) for r, rate in enumerate((50.0, 30.0, 54.0))]
    ours.append(point("draft", 4, 0, 500.0))  # not plain: not compared
    theirs = [point("none", 4, r, rate, "vllm") for r, rate in enumerate((50.0, 60.0))]
    theirs.append(point("ngram", 4, 0, 900.0, "vllm"))  # vLLM's n-gram server: not plain
    assert against_vllm(ours, theirs) == {4: round(50.0 / 55.0, 3)}


def test_the_comparison_table_puts_each_method_of_both_servers_side_by_side() -> None:
    ours = [point("none", c, r, 10.0 * c + r) for c in (1, 4) for r in range(3)]
    ours += [point("ngram", c, r, 20.0 * c + r) for c in (1, 4) for r in range(3)]
    theirs = [point("none", c, r, 30.0 * c + r, "vllm") for c in (1, 4) for r in range(2)]
    theirs += [point("ngram", 1, 0, 77.0, "vllm")]  # no point at 4 clients: an empty cell
    assert comparison_table(ours, theirs).splitlines() == [
        "| tok/s | 1 clients | 4 clients |",
        "|---|---:|---:|",
        "| Specgate none | 11.0 | 41.0 |",
        "| Specgate ngram | 21.0 | 81.0 |",
        "| vLLM none | 30.5 | 120.5 |",
        "| vLLM ngram | 77.0 |  |",
    ]
