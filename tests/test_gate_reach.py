"""The gate's summary says what each kernel's examples reached: the Triton kernels they launched,
the switches that took both values, the production sizes drawn, and what earlier runs launched
and this one never did."""
from nanfuzz.harness.gate.report import GateResult, Row, reach_lines, remember_paths
from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.reference.case import Case, Geometry, Poison, Sequence

DECODE = Case(Geometry(1, 1, 32, 16, 2, "float16"), (Sequence(1, 5, (1,)),), poison=Poison("nan", "v", None))
LONG = Case(Geometry(1, 1, 32, 16, 70, "float16"), (Sequence(1, 1100, tuple(range(1, 70))),),
            poison=Poison("nan", "v", None))


def _result(*launches) -> GateResult:
    stats = Statistics()
    for case, paths in launches:
        stats.add(case, paths)
    return GateResult([Row("k@v", 0, "cpu0", "gw0", stats.examples, 1.0, "PASS", "PASS", statistics=stats.to_dict())],
                      [], [])


def test_the_summary_names_the_kernels_switches_and_sizes_reached():
    two_d = {"kernel_unified_attention": ["kernel_unified_attention[IS_3D=False,TILE=16]"]}
    three_d = {"kernel_unified_attention": ["kernel_unified_attention[IS_3D=True,TILE=16]"], "reduce_segments": ["reduce_segments[]"]}
    text = "\n".join(reach_lines(_result((DECODE, two_d), (LONG, three_d))))
    assert "`kernel_unified_attention` 100%" in text and "`reduce_segments` 50%" in text
    assert "kernel_unified_attention IS_3D=True 50%" in text and "IS_3D=False 50%" in text
    assert "seq-len>=1024 50%" in text


def test_kernels_earlier_runs_launched_and_this_one_never_did_are_named(tmp_path):
    both = {"kernel_2d": ["kernel_2d[]"], "kernel_3d": ["kernel_3d[]"]}
    first = _result((DECODE, both))
    remember_paths(first, tmp_path)
    assert first.paths_missed == {}
    second = _result((DECODE, {"kernel_2d": ["kernel_2d[]"]}))
    remember_paths(second, tmp_path)
    assert second.paths_missed == {"k@v": ["kernel_3d"]}
    assert "never launched this run, launched by earlier runs**: `kernel_3d`" in "\n".join(reach_lines(second))
