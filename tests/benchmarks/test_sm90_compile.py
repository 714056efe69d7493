"""benchmarks/sm90_compile.py: the case syntax and the reading of ptxas's resource report. The
compile itself needs jax's CUDA plugin, which the CPU suite does not install."""

from pathlib import Path

import pytest

from helpers import example_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sm90_compile.py"

# ptxas's report for two kernels, in the form MOSAIC_GPU_DUMP_PTXAS prints it (the second spills).
REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'pallas_flash_mosaic_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for pallas_flash_mosaic_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'pallas_flash_mosaic_bwd_fused_mosaic_gpu_kernel', 116 bytes spill stores, 124 bytes spill loads
ptxas info    : Compiling entry function 'pallas_flash_mosaic_bwd_fused_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for pallas_flash_mosaic_bwd_fused_mosaic_gpu_kernel
    88 bytes stack frame, 116 bytes spill stores, 124 bytes spill loads
ptxas info    : Used 128 registers, used 16 barriers, 88 bytes cumulative stack size, 1 bytes smem
"""


@pytest.fixture(scope="module")
def sm90():
    with example_module(SCRIPT, "sm90_compile") as module:
        yield module


def test_parse_case(sm90):
    case = sm90.parse_case("2x8kx16x4x112:causal:step")
    assert case["shape"] == [2, 8192, 16, 4, 112]
    assert (case["pass"], case["causal"]) == ("step", True)
    assert not sm90.parse_case("1x1000x2x2x64:full:fwd")["causal"]
    decode = sm90.parse_case("decode:4x16kx32x8x128:4")
    assert decode["shape"] == [4, 16384, 32, 8, 128]
    assert (decode["pass"], decode["q_len"]) == ("decode", 4)


@pytest.mark.parametrize("text,match", [
    ("2x8kx16x16x128:causal", "SHAPE:MASK:PASS"),          # no pass
    ("2x8kx16x128:causal:step", "BATCHxSEQ"),              # four dimensions
    ("2x8kx16x16x128:window:step", "MASK is one of"),      # not a mask
    ("2x8kx16x16x128:causal:bwd", "PASS one of"),          # not a pass of this script
    ("decode:1x4kx32x8x128", "decode:SHAPE:Q_LEN"),        # no q_len
])
def test_parse_case_rejects(sm90, text, match):
    with pytest.raises(ValueError, match=match):
        sm90.parse_case(text)


def test_parse_ptxas(sm90):
    fwd, bwd = sm90.parse_ptxas(REPORT)
    assert fwd == {"kernel": "pallas_flash_mosaic_fwd", "stack": 0, "spill_stores": 0,
                   "spill_loads": 0, "registers": 168}
    # The warning line before a kernel's entry is not that kernel's report: its own is.
    assert bwd == {"kernel": "pallas_flash_mosaic_bwd_fused", "stack": 88, "spill_stores": 116,
                   "spill_loads": 124, "registers": 128}
    assert sm90.parse_ptxas("no report here") == []


def test_format_row(sm90):
    row = {"case": "2x8kx16x16x112:full:step", "backend": "mosaic", "dtype": "bfloat16",
           "trace_s": 0.4, "lower_s": 5.2, "compile_s": 6.1,
           "kernels": sm90.parse_ptxas(REPORT)}
    text = sm90.format_row(row)
    assert "lower 5.20 s, compile 6.10 s" in text
    assert "pallas_flash_mosaic_bwd_fused" in text and "spills 116 B stored / 124 B loaded" in text
    error = sm90.format_row({**row, "error": "RuntimeError: no cuda plugin"})
    assert error.endswith("error: RuntimeError: no cuda plugin")


def test_layout_inference_watch(sm90):
    """Lowering a Mosaic GPU kernel for cuda (no GPU needed) inside the watch records its
    layout inference under the kernel's name; the solver's functions are restored after."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import layout_inference
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                          kernel_name="watched")
    before = layout_inference.infer_layout
    with sm90.layout_inference_watch() as records:
        jax.jit(kernel).trace(jnp.zeros((128,), jnp.float32)).lower(
            lowering_platforms=("cuda",))
    assert [r["kernel"] for r in records] == ["watched"]
    assert records[0]["seconds"] > 0 and records[0]["guesses"] >= 0
    assert layout_inference.infer_layout is before
    row = {"case": "decode:1x4kx32x8x128:1", "backend": "mosaic", "dtype": "bfloat16",
           "trace_s": 0.1, "lower_s": 0.6, "compile_s": 0.6, "kernels": [],
           "layout_inference": [{"kernel": "pallas_flash_decode_mosaic", "seconds": 0.25,
                                 "guesses": 17}]}
    assert "layout inference of pallas_flash_decode_mosaic: 0.25 s, 17 guesses" in \
        sm90.format_row(row)


def test_table(sm90):
    fused = sm90.parse_ptxas(REPORT)
    two = [dict(fused[0]), {"kernel": "pallas_flash_mosaic_bwd_dq", "registers": 232,
                            "stack": 216, "spill_stores": 212, "spill_loads": 228}]
    rows = [{"case": "2x8kx16x16x112:full:step", "kernels": fused},
            {"case": "2x8kx8x8x256:full:step", "kernels": two},
            {"case": "2x8kx8x8x512:full:step", "kernels": [], "error": "ValueError: head_dim"}]
    lines = sm90.table(rows).splitlines()
    assert lines[0] == "| case | fwd | bwd_fused | bwd_dq |"
    assert lines[2] == "| 2x8kx16x16x112:full:step | 168 r, 0 / 0 | 128 r, 116 / 124 | – |"
    assert lines[3] == "| 2x8kx8x8x256:full:step | 168 r, 0 / 0 | – | 232 r, 212 / 228 |"
    assert lines[4].startswith("| 2x8kx8x8x512:full:step | error: ValueError: head_dim")
    assert len(lines) == 5          # no assembler recorded, no line for it


# XLA's log lines naming the assemblers it set up (TF_CPP_VMODULE=assemble_compilation_provider=3):
# XLA's own, then Mosaic GPU's, found on PATH.
LOG = """\
I1205 11:06:22.584365   20900 assemble_compilation_provider.cc:226] Using ptxas(path=/venv/nvidia/cu13/bin/ptxas, version=13.5.37) and nvlink(path=/venv/nvidia/cu13/bin/nvlink, version=13.5.37) for compilation and linking.
I1205 11:06:22.600000   20900 subprocess_compilation.cc:349] ptxas warning : Registers are spilled
I1205 11:06:23.034357   20900 assemble_compilation_provider.cc:226] Using ptxas(path=/usr/local/bin/ptxas, version=13.0.88) and nvlink(path=/usr/local/bin/nvlink, version=13.0.88) for compilation and linking.
I1205 11:06:24.034357   20900 assemble_compilation_provider.cc:226] Using ptxas(path=/usr/local/bin/ptxas, version=13.0.88) and nvlink(path=/usr/local/bin/nvlink, version=13.0.88) for compilation and linking.
"""
NAMES = ["ptxas 13.5.37 (/venv/nvidia/cu13/bin/ptxas)", "ptxas 13.0.88 (/usr/local/bin/ptxas)"]


def test_parse_assemblers(sm90):
    assert sm90.parse_assemblers(LOG) == NAMES
    assert sm90.parse_assemblers(
        "Using libnvptxcompiler for compilation and libnvjitlink for linking.") == [
            "libnvptxcompiler"]
    assert sm90.parse_assemblers(REPORT) == []


def test_assemblers_in_row_and_table(sm90):
    row = {"case": "2x8kx16x16x128:causal:step", "backend": "mosaic", "dtype": "bfloat16",
           "trace_s": 0.2, "lower_s": 2.7, "compile_s": 4.2,
           "assemblers": sm90.parse_assemblers(LOG), "kernels": sm90.parse_ptxas(REPORT)}
    assert sm90.format_row(row).splitlines()[0].endswith("compile 4.20 s, " + ", ".join(NAMES))
    lines = sm90.table([row, {**row, "case": "1x16kx16x16x128:causal:step"}]).splitlines()
    assert lines[-1] == "Assemblers XLA's log names: " + "; ".join(NAMES) + "."


def test_ptxas_dir_without_ptxas_is_refused(sm90, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sm90.main(["--ptxas-dir", str(tmp_path), "--cases", "1x128x2x2x64:full:fwd"])
    assert "holds no ptxas" in capsys.readouterr().err
