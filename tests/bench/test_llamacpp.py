"""llama.cpp as a `bench speed` contender: the grid, the checks made before any model loads, the
GGUF handling, and the llama-server client against a stand-in server (CI does not build
llama.cpp; the real runs are in benchmarks/cpu/llama-cpp)."""

import re
import sys
from pathlib import Path

import pytest

from smcspec import LLM, cli
from smcspec.bench import llamacpp
from smcspec.bench.contenders import build_grid
from smcspec.bench.results import measurements
from smcspec.bench.speed import SpeedPlan, run_speed
from smcspec.engine import gguf_files
from smcspec.models.toy import perturbed_lm, random_lm
from tests.bench.test_runs import WordTokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_grid_runs_every_quant_and_speculation_at_every_sd_k():
    grid = build_grid(["llama-cpp", "llama-cpp-spec"], [2, 4], [2], [2], quants=["Q4_K_M", "Q8_0"])
    assert [c.label for c in grid] == [
        "llama-cpp Q4_K_M",
        "llama-cpp Q8_0",
        "llama-cpp-spec Q4_K_M K=2",
        "llama-cpp-spec Q4_K_M K=4",
        "llama-cpp-spec Q8_0 K=2",
        "llama-cpp-spec Q8_0 K=4",
    ]
    with pytest.raises(ValueError, match="quant"):
        build_grid(["llama-cpp"], [2], [2], [2], quants=[])
    with pytest.raises(ValueError, match=r"not a llama\.cpp quant name: Q4;x"):
        build_grid(["llama-cpp"], [2], [2], [2], quants=["Q4;x"])


def test_draft_temperatures_add_sd_and_smc_rows_and_nothing_else():
    grid = build_grid(["ar", "sd", "smc"], [4], [2], [8], draft_temperatures=[None, 2.0])
    assert [c.label for c in grid] == [
        "ar",
        "sd K=4",
        "sd K=4 draft T=2",
        "smc N=2 K=8",
        "smc N=2 K=8 draft T=2",
    ]
    assert "draft_temperature" not in grid[1].settings  # None: generate's own default
    with pytest.raises(ValueError, match="draft_temperature"):
        build_grid(["sd"], [4], [2], [8], draft_temperatures=[-1.0])


def test_the_script_builds_the_version_the_bench_looks_for():
    script = (ROOT / "scripts" / "build_llama_cpp").read_text()
    assert re.search(r"^VERSION=(\S+)$", script, re.M).group(1) == llamacpp.VERSION


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "llama-cpp"], "./scripts/build_llama_cpp"),
        (["--methods", "ar", "llama-cpp-spec", "--natural-stop"], "fixed length"),
        (["--methods", "llama-cpp", "--quants", "Q4;x"], "not a llama.cpp quant name"),
        (["--methods", "sd", "--draft-temperatures", "x"], "list of numbers"),
    ],
)
def test_bench_speed_says_what_is_wrong_before_loading(argv, message, tmp_path, capsys):
    assert cli.main(["bench", "speed", *argv, "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not (tmp_path / "models").exists()


def test_other_benches_refuse_llama_cpp(capsys):
    assert cli.main(["bench", "roofline", "--methods", "llama-cpp"]) == 2
    assert "bench speed only" in capsys.readouterr().err


def test_gguf_files_takes_gguf_files_and_names_what_is_not_one(tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    assert gguf_files(str(target), str(draft)) == (target, draft)
    with pytest.raises(ValueError, match=r"draft: llama\.cpp reads \.gguf files"):
        gguf_files(str(target), str(tmp_path))


def _gguf(path: Path, file_type: int) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen2")
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tool(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    (folder / name).chmod(0o755)


def test_the_files_own_type_runs_as_given_and_others_are_made_once(tmp_path):
    from gguf import LlamaFileType

    target = _gguf(tmp_path / "t.gguf", LlamaFileType.MOSTLY_Q4_K_M)
    draft = _gguf(tmp_path / "d.gguf", LlamaFileType.MOSTLY_Q5_0)
    assert llamacpp.file_type(target) == "Q4_K_M"
    bins = tmp_path / "bin"
    _tool(bins, "llama-quantize", "import shutil; shutil.copy(sys.argv[2], sys.argv[3])")
    assert llamacpp.pair_for("Q4_K_M", target, draft, bins) == llamacpp.GGUFPair(
        "Q4_K_M", target, draft
    )
    made = llamacpp.pair_for("Q8_0", target, draft, bins)
    assert made.target == tmp_path / "t-Q8_0.gguf" and made.draft == tmp_path / "d-Q8_0.gguf"
    _tool(bins, "llama-quantize", "print('invalid ftype'); sys.exit(1)")
    assert llamacpp.pair_for("Q8_0", target, draft, bins) == made  # cached, not made again
    with pytest.raises(ValueError, match=r"could not make Q6_K .*invalid ftype"):
        llamacpp.pair_for("Q6_K", target, draft, bins)
    assert not list(tmp_path.glob("*partial*"))


FAKE_SERVER = """
import json, http.server
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
open(sys.argv[0] + ".args", "w").write(json.dumps(args))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["n_predict"]
        timings = {"prompt_ms": 20.0, "predicted_ms": 180.0, "predicted_n": n,
                   "draft_n": 8, "draft_n_accepted": 6}
        self._send({"tokens": [7] * n, "timings": timings, "echo": body})

    def _send(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_speculative_runs_on_llama_server_with_its_own_timings(tmp_path):
    bins = tmp_path / "bin"
    _tool(bins, "llama-server", FAKE_SERVER)
    pair = llamacpp.GGUFPair("Q8_0", tmp_path / "t.gguf", tmp_path / "d.gguf")
    with llamacpp.LlamaCpp({"Q8_0": pair}, bins, threads=2) as peer:
        out = peer.run("llama-cpp-spec", {"quant": "Q8_0", "draft_tokens": 4}, [1, 2], 0.7, 5, 3)
        server = peer._servers[("Q8_0", 4)]
        assert out["token_ids"] == [7] * 5 and out["seconds"] == pytest.approx(0.2)
        assert out["tokens_per_second"] == pytest.approx(25.0)
        assert out["time_split"]["prefill"] == pytest.approx(0.02)
        assert out["acceptance_rate"] == pytest.approx(0.75)
    assert server.proc.poll() is not None  # stopped on leaving the block
    args = (bins / "llama-server.args").read_text()
    for flag in ('"-md"', '"--spec-draft-n-max", "4"', '"-t", "2"', '"-td", "2"'):
        assert flag in args


def test_a_server_that_dies_at_start_is_reported(tmp_path):
    bins = tmp_path / "bin"
    _tool(bins, "llama-server", "print('error: unknown argument: -md'); sys.exit(1)")
    pair = llamacpp.GGUFPair("Q8_0", tmp_path / "t.gguf", tmp_path / "d.gguf")
    peer = llamacpp.LlamaCpp({"Q8_0": pair}, bins, threads=2)
    with peer, pytest.raises(RuntimeError, match="unknown argument: -md"):
        peer.run("llama-cpp-spec", {"quant": "Q8_0", "draft_tokens": 4}, [1], 0.7, 2, 0)


class StandIn:
    """What run_speed needs from the llama.cpp side, without llama.cpp."""

    def __init__(self):
        self.calls = []

    def describe(self):
        return {"llama_cpp_python": "stand-in"}

    def run(self, method, settings, prompt_ids, temperature, max_new, seed):
        self.calls.append((method, settings["quant"], temperature, max_new, seed))
        return llamacpp._result([5] * max_new, 0.5, 0.1, seed)


def test_speed_interleaves_llama_cpp_with_ours(tmp_path):
    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5), WordTokenizer())
    grid = build_grid(["ar", "llama-cpp"], [2], [2], [2], quants=["Q8_0"])
    peer = StandIn()
    run_speed(llm, SpeedPlan(grid, [0.7], prompts=2, max_new_tokens=6), tmp_path, llama_cpp=peer)
    records = measurements(tmp_path / "speed.jsonl")
    assert sorted(r["label"] for r in records) == ["ar", "ar", "llama-cpp Q8_0", "llama-cpp Q8_0"]
    # one untimed warm-up of 4 tokens, then each prompt at the plan's length and seed
    assert [c[3:] for c in peer.calls] == [(4, 0), (6, 0), (6, 1)]
    assert "| llama-cpp Q8_0 |" in (tmp_path / "speed.md").read_text()
    assert '"llama_cpp_python": "stand-in"' in (tmp_path / "speed.jsonl").read_text()
