"""tools/profile_step.py's reading of Nsight Compute's raw CSV (runs everywhere)."""
import os

import numpy as np
import pytest

TOOLS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")

HEADER = ('"ID","Process ID","Kernel Name","gpu__time_duration.sum",'
          '"sm__warps_active.avg.pct_of_peak_sustained_active","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
          '"gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","launch__grid_size",'
          '"launch__block_size"')


@pytest.fixture
def profile(monkeypatch):
    monkeypatch.syspath_prepend(TOOLS_DIR)
    import profile_step
    return profile_step


def csv_text(time_unit, rows):
    lines = ["==PROF== Connected to process 1234", HEADER,
             f'"","","","{time_unit}","%","%","%","",""']
    lines += [",".join(f'"{v}"' for v in row) for row in rows]
    return "\n".join(lines + ["==PROF== Disconnected from process 1234"])


def test_rows_are_read_in_launch_order_with_units_and_limits(profile):
    rows = profile.table(csv_text("nsecond", [
        ("0", "1", "linear_forward_relu_64x64_cp16_tf32(const float *, int)", "25,440", "11.3", "31.1", "44.0",
         "256", "128"),
        ("1", "1", "adamw_step", "13630", "42.0", "36.4", "29.8", "528", "256"),
        ("2", "1", "sumtree_update", "5150", "3.1", "0.1", "0.5", "4", "64"),
    ]))
    assert [r["kernel"] for r in rows] == ["linear_forward_relu_64x64_cp16_tf32", "adamw_step", "sumtree_update"]
    assert [r["time"] for r in rows] == pytest.approx([25.44, 13.63, 5.15])
    assert [r["limit"] for r in rows] == ["memory", "SM", "latency"]
    assert (rows[0]["grid"], rows[0]["block"], rows[0]["occupancy"]) == ("256", "128", 11.3)


def test_microsecond_durations_are_not_rescaled(profile):
    (row,) = profile.table(csv_text("usecond", [("0", "1", "k", "7.5", "1", "50", "10", "1", "32")]))
    assert row["time"] == pytest.approx(7.5) and row["limit"] == "SM"


def test_output_without_kernels_gives_no_rows(profile):
    assert profile.table("==PROF== Connected\nno kernels were profiled\n") == []
    assert profile.table(csv_text("nsecond", [])) == []


HBM_HEADER = ('"ID","Process ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum",'
              '"gpu__time_duration.sum","launch__block_size","launch__grid_size","lts__t_sector_hit_rate.pct"')


def test_hbm_rows_are_megabytes_by_their_units_and_the_command_leaves_the_cache(profile):
    """``--hbm``: two rows of a real run of the large DQN step (bytes as ncu wrote them, one
    column given in Kbyte instead), read as 10^6 bytes, no limit column; its ncu command
    neither flushes the caches nor replays a kernel alone, and the default command does not
    change."""
    text = "\n".join(["==PROF== Connected to process 490", HBM_HEADER, '"","","","byte","Kbyte","ns","","","%"',
                      '"0","1","adamw_clip_step","8,966,656","7,988.992","13,280","256","528","71.07"',
                      '"1","1","dqn_finish(float *, float *)","3,875,840","3,794.688","10,016","256","528","78.40"'])
    rows = profile.table(text, profile.HBM_METRICS)
    assert [r["kernel"] for r in rows] == ["adamw_clip_step", "dqn_finish"]
    assert [r["read"] for r in rows] == pytest.approx([8.966656, 3.87584])
    assert [r["written"] for r in rows] == pytest.approx([7.988992, 3.794688])
    assert [r["time"] for r in rows] == pytest.approx([13.28, 10.016])
    assert (rows[0]["l2_hit"], rows[0]["grid"], rows[0]["block"]) == (71.07, "528", "256") and "limit" not in rows[0]
    cmd = profile.ncu_command("ncu", "dqn-large", 3, "hbm")
    assert cmd[cmd.index("--cache-control") + 1] == "none"
    assert cmd[cmd.index("--replay-mode") + 1] == "application"
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(profile.HBM_METRICS)
    default = profile.ncu_command("ncu", "dqn-large", 3)
    assert "--cache-control" not in default and "--replay-mode" not in default
    assert default[default.index("--metrics") + 1].split(",") == list(profile.METRICS)
    assert cmd[-4:] == default[-4:] == ["--child", "--warmup", "3", "dqn-large"]


def test_hbm_table_prints_the_totals_and_a_row_per_kernel(profile, capsys):
    """The printed ``--hbm`` table: the step's totals over every kernel, then one row a
    kernel in launch order; a byte unit ncu never wrote reads as NaN, not as bytes."""
    text = "\n".join([HBM_HEADER, '"","","","byte","Mbyte","us","","","%"',
                      '"0","1","sumtree_sample","780,000","0.26","10.56","128","128","58.4"',
                      '"1","1","dqn_finish","650,000","1.64","9.47","256","528","94.5"'])
    rows = profile.table(text, profile.HBM_METRICS)
    profile.print_hbm_table("dqn-large", rows)
    out = capsys.readouterr().out.splitlines()
    assert "dqn-large: 2 kernels, 1.43 MB read from HBM and 1.90 MB written to it" in out[1]
    assert out[-2:] == ["| 0 | sumtree_sample | 10.56 | 128 x 128 | 0.78 | 0.26 | 58.4 |",
                        "| 1 | dqn_finish | 9.47 | 528 x 256 | 0.65 | 1.64 | 94.5 |"]
    odd = profile.table(text.replace('"byte","Mbyte"', '"byte","Tbyte"'), profile.HBM_METRICS)
    assert [r["written"] != r["written"] for r in odd] == [True, True]


L2_HEADER = ('"ID","Process ID","Kernel Name","gpu__time_duration.sum","launch__block_size","launch__grid_size",'
             '"lts__t_bytes.sum","lts__throughput.avg.pct_of_peak_sustained_elapsed",'
             '"sm__warps_active.avg.pct_of_peak_sustained_active"')


def test_l2_rows_and_table_give_bytes_rates_and_the_command_leaves_the_cache(profile, capsys):
    """``--l2``: the bytes through the L2 read as 10^6 bytes by their unit (here Kbyte),
    the printed rate is those bytes over the kernel's time (MB/us = TB/s, NaN for a
    kernel of no time), the total is over every kernel; the ncu command, like
    ``--hbm``'s, neither flushes the caches nor replays a kernel alone, and asks for
    exactly L2_METRICS; an unknown mode is refused."""
    text = "\n".join(["==PROF== Connected to process 77", L2_HEADER, '"","","","ns","","","Kbyte","%","%"',
                      '"0","1","linear_grad_weight_32x32_cp16_cluster_3xtf32(const float *)","5,120","128",'
                      '"256","6,400","38.5","21.7"',
                      '"1","1","dqn_finish","2,500","256","67","750","12.0","30.2"',
                      '"2","1","probe","0","32","1","1","0.1","3.0"'])
    rows = profile.table(text, profile.L2_METRICS)
    assert [r["kernel"] for r in rows] == ["linear_grad_weight_32x32_cp16_cluster_3xtf32", "dqn_finish", "probe"]
    assert [r["l2"] for r in rows] == pytest.approx([6.4, 0.75, 0.001])
    assert [r["time"] for r in rows] == pytest.approx([5.12, 2.5, 0.0])
    assert (rows[0]["l2_peak"], rows[0]["occupancy"], rows[0]["grid"]) == (38.5, 21.7, "256") and "limit" not in rows[0]
    profile.print_l2_table("dqn-small", rows)
    out = capsys.readouterr().out.splitlines()
    assert "dqn-small: 3 kernels, 7.15 MB through the L2" in out[1]
    assert out[-3:] == [
        "| 0 | linear_grad_weight_32x32_cp16_cluster_3xtf32 | 5.12 | 256 x 128 | 6.40 | 1.25 | 38.5 | 21.7 |",
        "| 1 | dqn_finish | 2.50 | 67 x 256 | 0.75 | 0.30 | 12.0 | 30.2 |",
        "| 2 | probe | 0.00 | 1 x 32 | 0.00 | nan | 0.1 | 3.0 |"]
    cmd = profile.ncu_command("ncu", "dqn-small", 2, "l2")
    assert cmd[cmd.index("--cache-control") + 1] == "none"
    assert cmd[cmd.index("--replay-mode") + 1] == "application"
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(profile.L2_METRICS)
    assert cmd[-4:] == ["--child", "--warmup", "2", "dqn-small"]
    with pytest.raises(ValueError, match="unknown mode"):
        profile.ncu_command("ncu", "dqn-small", 2, "l1")


def test_hbm_and_l2_tables_are_one_or_the_other(profile, capsys):
    """``--hbm`` and ``--l2`` choose different tables: asking for both is refused before
    anything runs (no device needed)."""
    with pytest.raises(SystemExit) as exit_info:
        profile.main(["--hbm", "--l2"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_trace_timeline_takes_medians_per_node_and_refuses_other_graphs(monkeypatch):
    """tools/trace_step.py's reading of a Chrome trace: per node of the replayed graph, the median
    start relative to the replay's first kernel and the median duration; nodes matched by stream,
    name and occurrence, so two concurrent kernels that swap their start order stay themselves."""
    monkeypatch.syspath_prepend(TOOLS_DIR)
    import trace_step
    events = [{"cat": "cpu_op", "name": "noise", "ts": 0.0, "dur": 1.0}]
    for rep, (t0, d_a, d_b) in enumerate([(100.0, 2.0, 5.0), (200.0, 4.0, 6.0), (300.0, 3.0, 7.0)]):
        events.append({"cat": "kernel", "name": "a", "ts": t0, "dur": d_a, "args": {"stream": 7, "grid": [4, 1, 1]}})
        events.append({"cat": "kernel", "name": "b", "ts": t0 + 1.0 + rep, "dur": d_b, "args": {"stream": 8}})
        # c on stream 9 starts before b in the first replay, after it in the others
        events.append({"cat": "kernel", "name": "c", "ts": t0 + (1.5 if rep else 0.5), "dur": 1.0,
                       "args": {"stream": 9}})
        events.append({"cat": "kernel", "name": "a", "ts": t0 + 10.0, "dur": 1.0, "args": {"stream": 7}})
    rows = trace_step.timeline(events, 3, 0)
    assert [(r["name"], r["stream"]) for r in rows] == [("a", 7), ("c", 9), ("b", 8), ("a", 7)]
    assert rows[0]["start"] == 0.0 and rows[0]["dur"] == 3.0 and rows[0]["grid"] == [4, 1, 1]
    assert rows[1]["start"] == 1.5
    assert rows[2]["start"] == 2.0 and rows[2]["dur"] == 6.0 and rows[2]["end"] == 8.0
    assert rows[3]["start"] == 10.0
    assert trace_step.timeline(events, 3, 2)[2]["start"] == 3.0  # only the last replay
    with pytest.raises(ValueError, match="do not split"):
        trace_step.timeline(events[:-1], 3, 0)
    other = [dict(e, name="d") if e.get("name") == "b" and e["ts"] > 250 else e for e in events]
    with pytest.raises(ValueError, match="different kernels"):
        trace_step.timeline(other, 3, 0)


def test_replay_stamps_give_median_spans_gaps_and_periods(monkeypatch):
    """tools/stamp_replays.py's reading of the stamps: per replay its span (second stamp less
    first), the gap to the next replay's first stamp and the period between first stamps, in
    us, medians over the replays kept; stamps out of order or too few replays refused."""
    monkeypatch.syspath_prepend(TOOLS_DIR)
    import stamp_replays
    rng = np.random.default_rng(3)
    spans = rng.integers(30_000, 40_000, 9)
    gaps = rng.integers(500, 3_000, 8)
    starts = np.concatenate([[1_000_000], 1_000_000 + np.cumsum(spans[:-1] + gaps)])
    stamps = np.stack([starts, starts + spans], axis=1)
    got = stamp_replays.spans_and_gaps(stamps)
    want = (np.median(spans), np.median(gaps), np.median(spans[:-1] + gaps))
    assert got == pytest.approx(np.array(want) / 1e3, rel=1e-12)
    got = stamp_replays.spans_and_gaps(stamps, skip=6)  # replays 6, 7, 8 kept
    want = (np.median(spans[6:]), np.median(gaps[6:]), np.median(spans[6:8] + gaps[6:]))
    assert got == pytest.approx(np.array(want) / 1e3, rel=1e-12)
    with pytest.raises(ValueError, match="fewer than two"):
        stamp_replays.spans_and_gaps(stamps, skip=8)
    with pytest.raises(ValueError, match="out of order"):
        stamp_replays.spans_and_gaps(stamps[::-1])
    overlapping = stamps.copy()
    overlapping[4, 0] = overlapping[3, 1] - 1
    with pytest.raises(ValueError, match="out of order"):
        stamp_replays.spans_and_gaps(overlapping)
    with pytest.raises(ValueError, match="shape"):
        stamp_replays.spans_and_gaps(stamps.ravel())


def test_a_stamped_graph_is_bracketed_by_its_stamps_alone(monkeypatch):
    """tools/stamp_replays.py's check of the stamped graph: the first stamp its only root, the
    second its only leaf; a second root or leaf (a branch the stamps do not hold) fails."""
    monkeypatch.syspath_prepend(TOOLS_DIR)
    import stamp_replays
    # 0 -> {1, 2} -> 3 -> 4, the stamps 0 and 4
    edges = [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]
    assert stamp_replays.bracketed(5, edges, [0, 4])
    assert not stamp_replays.bracketed(5, edges, [4, 0])
    assert not stamp_replays.bracketed(6, edges, [0, 4])  # node 5 hangs free: a root and a leaf
    assert not stamp_replays.bracketed(5, [(0, 1), (0, 2), (1, 3), (3, 4)], [0, 4])  # 2 ends apart
    assert not stamp_replays.bracketed(5, [(0, 1), (2, 1), (1, 3), (3, 4)], [0, 4])  # 2 starts apart
    assert not stamp_replays.bracketed(5, edges, [0])


TENSOR_HEADER = ('"ID","Process ID","Kernel Name","gpu__time_duration.sum","launch__block_size","launch__grid_size",'
                 '"sm__inst_executed_pipe_tensor_op_gmma.sum","sm__inst_executed_pipe_tensor_op_hmma.sum",'
                 '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",'
                 '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"')


def test_tensor_rows_keep_both_shares_and_the_instruction_counts(profile, capsys):
    """``--tensor``: the tensor pipe's share over the active cycles and over all SMs, read
    apart (the columns in ncu's order, not the table's), the instruction counts (wgmma, and
    every tensor instruction, which counts the wgmma ones too) without their thousands
    separators; its command asks for exactly those metrics, as the
    default table (no cache or replay options)."""
    text = "\n".join([
        "==PROF== Connected to process 77", TENSOR_HEADER, '"","","","usecond","","","inst","inst","%","%"',
        '"0","1","linear_forward_relu_head_wgmma_tf32","21.41","256","32","1,048,576","1,048,576","61.25","14.85"',
        '"1","1","adamw_clip_step(float *)","14.27","256","528","0","0","0","0"',
        '"2","1","linear_grad_weight_32x32_cp4_cluster_3xtf32","6.91","128","32","0","98,304","3.5","0.8"'])
    rows = profile.table(text, profile.TENSOR_METRICS)
    assert [r["kernel"] for r in rows] == ["linear_forward_relu_head_wgmma_tf32", "adamw_clip_step",
                                           "linear_grad_weight_32x32_cp4_cluster_3xtf32"]
    assert [(r["tensor_active"], r["tensor_elapsed"]) for r in rows] == [(61.25, 14.85), (0, 0), (3.5, 0.8)]
    assert [(r["wgmma"], r["tensor_inst"]) for r in rows] == [(1048576, 1048576), (0, 0), (0, 98304)]
    assert [r["time"] for r in rows] == pytest.approx([21.41, 14.27, 6.91]) and "limit" not in rows[0]
    cmd = profile.ncu_command("ncu", "dqn-large", 3, "tensor")
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(profile.TENSOR_METRICS)
    assert "--cache-control" not in cmd and "--replay-mode" not in cmd
    profile.print_tensor_table("dqn-large", rows)
    out = capsys.readouterr().out
    assert "| 0 | linear_forward_relu_head_wgmma_tf32 | 21.41 | 32 x 256 | 61.2 | 14.8 | 1048576 | 1048576 |" in out
    assert "| 2 | linear_grad_weight_32x32_cp4_cluster_3xtf32 | 6.91 | 32 x 128 | 3.5 | 0.8 | 0 | 98304 |" in out
