"""`llmjax`'s command line refuses bad input with `error: ...` and a non-zero status, never a
traceback: flag by flag at parse time (status 2), flag combinations before anything starts
(status 2), and what only building the engine finds (a model path, a backend, a KV budget;
status 1). Parse-level, or on the tiny presets."""

from __future__ import annotations

import argparse
import os
import socket

import jax
import pytest

from llmjax import cli_types
from llmjax.cli import main
from llmjax.config import DEFAULT_BATCH_SIZE, DEFAULT_MAX_DELAY, EngineConfig
from llmjax.engine_args import add_engine_args, engine_config_from_args
from llmjax.serve import routing


@pytest.fixture
def usage_error(cli_error, monkeypatch):
    """`usage_error(argv, message)`: assert that `llmjax ARGV` stops at parse time (argparse's
    `llmjax CMD: error: ...`, status 2) with `message`; building an engine, starting a replica or a
    router fails the test instead (a check that let the flags through)."""
    from llmjax.engine import LLMEngine
    from llmjax.serve import cluster, router

    def started(*args, **kwargs):
        raise AssertionError("the command started instead of refusing its flags")

    monkeypatch.setattr(LLMEngine, "from_config", started)
    monkeypatch.setattr(cluster.Replica, "start", started)
    monkeypatch.setattr(router, "serve_router", started)

    def check(argv: list[str], message: str) -> None:
        line, status = cli_error(*argv)
        assert status == 2 and f"llmjax {argv[0]}: error: " in line and message in line, line

    return check


# --- engine flags: generate, serve and cluster alike ---------------------------------------------------
COMMANDS = [["generate", "tiny-gqa", "--prompt", "hi"], ["serve", "tiny-gqa"],
            ["cluster", "tiny-gqa", "--replicas", "1"]]
ENGINE_FLAG_ERRORS = [
    (["--max-num-seqs", "0"], "max_num_seqs must be positive, got 0"),
    (["--block-size", "24"], "block_size must be a power of two"),
    (["--max-num-batched-tokens", "32"], "max_num_batched_tokens (32) < max_num_seqs (64)"),
    (["--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "max_num_batched_tokens (8) < max_num_seqs (16)"),
    (["--gpu-memory-utilization", "0"], "gpu_memory_utilization"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1048576"], "both size the KV cache"),
    (["--kv-cache-memory", "-1"], "kv_cache_memory_bytes must be positive"),
    (["--seed", "-1"], "seed must be >= 0"),
    (["--dtype", "int7"], "argument --dtype: invalid choice: 'int7'"),
    (["--queue-order", "lpm", "--no-enable-prefix-caching"], "queue_order 'lpm'"),
    (["--batch-size", "4"], "--batch-size applies to --scheduling-policy static or dynamic only, not continuous"),
    (["--max-delay", "0.1"], "--max-delay applies to --scheduling-policy dynamic only, not continuous"),
    (["--scheduling-policy", "static", "--max-delay", "0.1"], "--max-delay applies to --scheduling-policy dynamic"),
    (["--scheduling-policy", "dynamic", "--max-delay", "inf"], "max_delay must be a finite number of seconds"),
    (["--scheduling-policy", "dynamic", "--batch-size", "0"], "batch_size must be positive"),
    (["--scheduling-policy", "dynamic", "--batch-size", "8", "--max-num-seqs", "4"],
     "batch_size (8) > max_num_seqs (4)"),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512", "--max-model-len", "1024"],
     "max_num_batched_tokens (512) < max_model_len (1024)"),
    (["--compilation-cache-dir", ""], "compilation_cache_dir must not be empty"),
    (["--coordinator-address", " "], "coordinator_address must not be empty"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("flags, message", ENGINE_FLAG_ERRORS)
def test_bad_engine_flags_are_usage_errors_before_anything_starts(usage_error, command, flags, message):
    usage_error(command + flags, message)


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_batching_flags_reach_the_config_of_their_policy_and_default_otherwise():
    config = engine_config_from_args(engine_args("--scheduling-policy", "dynamic", "--batch-size", "3",
                                                 "--max-delay", "0.5"))
    assert (config.scheduling_policy, config.batch_size, config.max_delay) == ("dynamic", 3, 0.5)
    config = engine_config_from_args(engine_args("--scheduling-policy", "static", "--batch-size", "5"))
    assert (config.batch_size, config.max_delay) == (5, None)  # static reads no delay
    config = engine_config_from_args(engine_args("--scheduling-policy", "dynamic"))
    assert (config.batch_size, config.max_delay) == (DEFAULT_BATCH_SIZE, DEFAULT_MAX_DELAY)
    config = engine_config_from_args(engine_args())
    assert (config.scheduling_policy, config.batch_size, config.max_delay) == ("continuous", None, None)
    assert engine_config_from_args(engine_args("--dtype", "float16")).dtype == "float16"
    config = engine_config_from_args(engine_args("--dtype", "auto", "--kv-cache-dtype", "auto"))
    assert (config.dtype, config.kv_cache_dtype) == (None, None)  # vLLM's spelling of the defaults
    config = engine_config_from_args(engine_args("--scheduling-policy", "dynamic", "--max-num-seqs", "4"))
    assert config.batch_size == 4  # the default batch, capped at the seats


def test_without_chunked_prefill_the_default_budget_covers_the_context():
    default = EngineConfig()
    config = engine_config_from_args(engine_args("--no-enable-chunked-prefill"))
    assert config.max_num_batched_tokens == max(default.max_num_batched_tokens, default.max_model_len)
    config = engine_config_from_args(engine_args("--no-enable-chunked-prefill", "--max-model-len", "256"))
    assert config.max_num_batched_tokens == default.max_num_batched_tokens
    assert engine_config_from_args(engine_args()).max_num_batched_tokens == default.max_num_batched_tokens


@pytest.mark.parametrize("command", [["serve", "tiny-gqa"], ["cluster", "tiny-gqa", "--replicas", "1"]],
                         ids=lambda c: c[0])
def test_a_server_refuses_static_batching(usage_error, command):
    usage_error(command + ["--scheduling-policy", "static"], "use --scheduling-policy dynamic")


@pytest.mark.parametrize("command", [["serve", "tiny-gqa"], ["cluster", "tiny-gqa", "--replicas", "1"]],
                         ids=lambda c: c[0])
def test_a_server_refuses_the_multi_host_flags(usage_error, command):
    usage_error(command + ["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0",
                           "-tp", "2"], "a server runs on one host")


@pytest.mark.parametrize("flags, message", [(["--temperature", "-1"], "--temperature: temperature must be >= 0"),
                                            (["--max-tokens", "0"], "--max-tokens: max_tokens"),
                                            (["--top-p", "1.5"], "--top-p: top_p"),
                                            (["--top-p", "0.5", "--temperature", "0"], "--top-p has no effect"),
                                            (["--stream-interval", "4"], "--stream-interval has no effect"),
                                            (["--queue-order", "lpm", "--enable-prefix-caching"],
                                             "--queue-order has no effect"),
                                            (["--scheduling-policy", "dynamic"], "--scheduling-policy has no effect")])
def test_generate_checks_its_sampling_values_before_building_the_engine(usage_error, flags, message):
    usage_error(["generate", "tiny-gqa", "--prompt", "hi", *flags], message)


# --- what only building the engine finds: `error: ...`, status 1 -----------------------------------------
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_an_unknown_model_is_an_error_not_a_traceback(cli_error, command):
    line, status = cli_error(command[0], "no-such-model", *command[2:])
    assert status == 1 and line.startswith("error: model 'no-such-model' is neither a preset"), line


def test_an_attention_backend_not_usable_here_is_an_error(cli_error):
    unusable = "pallas" if jax.default_backend() == "cpu" else "cpu"
    line, status = cli_error("generate", "tiny-gqa", "--prompt", "hi", "--attention-backend", unusable)
    assert status == 1 and line.startswith(f"error: attention backend '{unusable}' needs"), line


@pytest.mark.parametrize("command", COMMANDS[:2], ids=lambda c: c[0])
def test_shapes_the_pallas_kernels_cannot_tile_are_an_error_when_the_engine_is_built(cli_error, command):
    """The kernels tile KV blocks in powers of two of at least 16: a block size of 8 is refused when
    the engine is built, not at its first step (where every request would fail)."""
    line, status = cli_error(command[0], "tiny-gqa", *command[2:], "--attention-backend", "pallas-interpret",
                             "--block-size", "8")
    assert status == 1 and line.startswith(
        "error: the Pallas attention backends: Pallas paged attention needs block_size a power of two >= 16, "
        "got 8"), line


def test_top_p_under_the_default_greedy_decoding_is_an_error(cli_error):
    """Without --temperature (and no generation config on the model), generate decodes greedily:
    a --top-p could have no effect."""
    line, status = cli_error("generate", "tiny-gqa", "--prompt", "hi", "--top-p", "0.5", "--attention-backend", "xla")
    assert status == 1 and line.startswith("error: --top-p has no effect at temperature 0"), line


def test_a_coordinator_address_without_a_port_is_refused(usage_error):
    usage_error(["generate", "tiny-gqa", "--prompt", "hi", "--coordinator-address", "notahost"],
                "coordinator_address must be host:port")


def test_a_multi_host_run_that_cannot_start_is_an_error(cli_error):
    line, status = cli_error("generate", "tiny-gqa", "--prompt", "hi", "--coordinator-address", "127.0.0.1:29511")
    assert status == 1 and line.startswith("error: joining the multi-host run at 127.0.0.1:29511 failed"), line


def test_a_kv_budget_beyond_the_hosts_memory_is_an_error(cli_error):
    line, status = cli_error("generate", "tiny-gqa", "--prompt", "hi", "--kv-cache-memory", str(10**15),
                             "--attention-backend", "xla")
    assert status == 1 and line.startswith("error: the KV cache would take"), line


def test_a_compilation_cache_dir_that_cannot_be_a_directory_is_an_error(cli_error, tmp_path):
    (tmp_path / "a-file").write_text("")
    line, status = cli_error("generate", "tiny-gqa", "--prompt", "hi", "--compilation-cache-dir",
                             str(tmp_path / "a-file"), "--attention-backend", "xla")
    assert status == 1 and line.startswith(f"error: compilation_cache_dir '{tmp_path / 'a-file'}' cannot be"), line


def test_a_kv_budget_below_two_blocks_is_an_error(cli_error):
    line, status = cli_error("serve", "tiny-gqa", "--kv-cache-memory", "1000", "--no-warmup", "--attention-backend",
                             "xla")
    assert status == 1 and line.startswith("error: KV budget of 1000 bytes holds 0 blocks"), line


def test_a_request_the_engine_failed_is_an_error_not_an_empty_answer(cli_error, monkeypatch):
    import llmjax.runner

    def broken_fetch(self, inflight):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llmjax.runner.ModelRunner, "fetch", broken_fetch)
    line, status = cli_error("generate", "tiny-gqa", "--prompt", "hi", "--attention-backend", "xla")
    assert status == 1 and line == "error: the engine step failed: RuntimeError: device lost", line


def test_an_internal_error_keeps_its_traceback(monkeypatch):
    """Only the user's errors become `error:` exits: a bug raises as it is."""
    import llmjax.llm

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(llmjax.llm, "LLM", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "tiny-gqa", "--prompt", "hi"])


# --- router and cluster flags ------------------------------------------------------------------------------
ROUTER_FLAG_ERRORS = [
    (["--max-tree-chars", "0"], "argument --max-tree-chars: expected a positive integer"),
    (["--health-check-interval", "0"], "argument --health-check-interval: expected a positive number of seconds"),
    (["--health-check-interval", "inf"], "argument --health-check-interval"),
    (["--health-check-timeout", "-1"], "argument --health-check-timeout"),
    (["--health-failure-threshold", "0"], "argument --health-failure-threshold: expected a positive integer"),
    (["--cache-threshold", "1.5"], "argument --cache-threshold: expected a number in [0, 1]"),
    (["--balance-abs-threshold", "-1"], "argument --balance-abs-threshold: expected an integer >= 0"),
    (["--balance-rel-threshold", "0"], "argument --balance-rel-threshold"),
    (["--policy", "round_robin", "--max-tree-chars", "100"], "--max-tree-chars applies to --policy cache_aware only"),
    (["--policy", "least_load", "--cache-threshold", "0.3", "--balance-abs-threshold", "4"],
     "--cache-threshold, --balance-abs-threshold apply to --policy cache_aware only, not least_load"),
]


@pytest.mark.parametrize("command", [["router", "--workers", "http://127.0.0.1:9"], ["cluster", "--replicas", "1"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("flags, message", ROUTER_FLAG_ERRORS)
def test_bad_router_flags_are_usage_errors(usage_error, command, flags, message):
    usage_error(command + flags, message)


@pytest.mark.parametrize("workers, message", [
    ("127.0.0.1:8000", "expected a URL like http://127.0.0.1:8000"),
    ("ftp://h:21", "expected a URL like"),
    ("http://", "expected a URL like"),
    ("http://h:99999", "bad URL"),
    ("http://h:8000/v1", "expected the server's root URL, without a path"),
    ("http://h:8000,http://h:8000/", "a URL is listed twice"),
    (",", "expected at least one URL"),
])
def test_worker_urls_need_a_scheme_and_a_host_and_no_path(usage_error, workers, message):
    usage_error(["router", "--workers", workers], f"argument --workers: {message}")


def test_worker_urls_and_router_defaults_as_parsed():
    assert cli_types.server_urls("http://a:1/, https://b") == ["http://a:1", "https://b"]
    parser = argparse.ArgumentParser()
    routing.add_router_args(parser)
    policy = routing.policy_from_args(parser.parse_args([]))
    assert (policy.cache_threshold, policy.max_tree_chars) == (routing.DEFAULT_CACHE_THRESHOLD,
                                                              routing.DEFAULT_MAX_TREE_CHARS)
    policy = routing.policy_from_args(parser.parse_args(["--max-tree-chars", "64", "--cache-threshold", "0"]))
    assert (policy.cache_threshold, policy.max_tree_chars) == (0.0, 64)



@pytest.mark.parametrize("argv, expected", [
    ([], (100, [0, 1, 2], False)),
    (["--quick"], (5, [0], False)),
    (["--quick", "--requests", "50"], (50, [0], False)),
    (["--quick", "--requests", "100"], (100, [0], False)),  # given, though equal to the default
    (["--seeds", "7", "--quick", "--skip-engine"], (5, [7], True)),
])
def test_quick_replaces_only_the_defaults_of_flags_not_given(argv, expected):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=cli_types.positive_int, default=100)
    parser.add_argument("--seeds", type=cli_types.non_negative_int_list, default=[0, 1, 2])
    parser.add_argument("--skip-engine", action="store_true")
    args = cli_types.parse_quick(parser, dict(requests=5, seeds=[0]), argv)
    assert (args.requests, args.seeds, args.skip_engine) == expected

@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "65536"], "argument --port: expected a port in 0..65535"),
    (["router", "--workers", "http://h:1", "--port", "-1"], "argument --port: expected a port in 0..65535"),
    (["cluster", "--replicas", "0"], "argument --replicas: expected a positive integer"),
    (["cluster", "--replicas", "1", "--replica-startup-timeout", "0"], "argument --replica-startup-timeout"),
    (["cluster", "--replicas", "1", "--port", "70000"], "argument --port"),
    (["cluster", "--replicas", "2", "--replica-base-port", "65535"], "the replicas' ports 65535..65536"),
    (["cluster", "--replicas", "1", "--port", "65535"], "the replicas' ports 65536..65536"),
    (["cluster", "--replicas", "1", "--replica-base-port", "0"], "the replicas' ports 0..0"),
    (["cluster", "--replicas", "3", "--port", "8002", "--replica-base-port", "8000"],
     "--port 8002 is also a replica's"),
    (["cluster", "--replicas", "1", "--port", "0"], "--port 0 (any free port) leaves the replicas' ports unknown"),
])
def test_ports_and_replicas_are_range_checked(usage_error, argv, message):
    usage_error(argv, message)


# An empty value is refused, never read as the flag's default (another model name, no API key, every
# interface, the server's first model, no result file).
@pytest.mark.parametrize("argv, flag", [
    (["serve", "tiny-gqa", "--served-model-name", ""], "--served-model-name"),
    (["serve", "tiny-gqa", "--api-key", ""], "--api-key"),
    (["serve", "tiny-gqa", "--api-key", "  "], "--api-key"),
    (["serve", "tiny-gqa", "--host", ""], "--host"),
    (["serve", ""], "model"),
    (["generate", " ", "--prompt", "hi"], "model"),
    (["cluster", "tiny-gqa", "--replicas", "1", "--served-model-name", " "], "--served-model-name"),
    (["cluster", "tiny-gqa", "--replicas", "1", "--api-key", ""], "--api-key"),
    (["cluster", "tiny-gqa", "--replicas", "1", "--host", ""], "--host"),
    (["router", "--workers", "http://127.0.0.1:9", "--host", ""], "--host"),
    (["bench", "--model", ""], "--model"),
    (["bench", "--result-file", ""], "--result-file"),
])
def test_empty_string_flags_are_refused(usage_error, argv, flag):
    usage_error(argv, f"argument {flag}: expected a non-empty value")


def test_cluster_replicas_get_their_own_gpus(usage_error, monkeypatch, tmp_path):
    """Replica i gets GPUs i*tp .. (i+1)*tp - 1 of those CUDA_VISIBLE_DEVICES (else nvidia-smi) lists, as
    its own CUDA_VISIBLE_DEVICES set before its runtime starts; too few GPUs is a usage error."""
    from llmjax.serve import cluster

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,GPU-ab12,7")
    assert cluster.visible_gpus() == ["3", "5", "GPU-ab12", "7"]
    assert cluster.replica_gpus(cluster.visible_gpus(), 2, 2) == ["3,5", "GPU-ab12,7"]
    assert cluster.replica_gpus(cluster.visible_gpus(), 3, 1) == ["3", "5", "GPU-ab12"]
    assert cluster.replica_gpus([], 2, 4) == [None, None]  # no GPUs: nothing assigned
    usage_error(["cluster", "tiny-gqa", "--replicas", "5"],
                "5 replicas of --tensor-parallel-size 1 need 5 GPUs; 4 visible")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert cluster.visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert cluster.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # a CPU run on a GPU machine assigns none
    assert cluster.visible_gpus() == []

    seen = []
    monkeypatch.setattr(cluster, "exit_with_parent", lambda pid: None)
    monkeypatch.setattr(cluster, "run_server", lambda args: seen.append(os.environ.get("CUDA_VISIBLE_DEVICES")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    cluster.serve_replica(argparse.Namespace(), 0, "2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    cluster.serve_replica(argparse.Namespace(), 0, None)
    assert seen == ["2,3", "0,1,2,3"]


def test_a_port_in_use_is_an_error_before_the_model_loads(cli_error, monkeypatch):
    """`serve` binds its port before it loads the model, `cluster` checks the router's and the
    replicas' ports before it starts one: a port in use is an `error:` at once."""
    from llmjax.engine import LLMEngine
    from llmjax.serve import cluster

    monkeypatch.setattr(LLMEngine, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(cluster.Replica, "start", lambda self: pytest.fail("a replica started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line, status = cli_error("serve", "tiny-gqa", "--port", str(port))
        assert status == 1 and line.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), line
        line, status = cli_error("cluster", "tiny-gqa", "--replicas", "1", "--port", "0", "--replica-base-port",
                                 str(port))
        assert status == 1 and line.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), line


def test_a_router_on_an_address_other_than_loopback_warns_that_it_checks_no_key(monkeypatch, capsys):
    import uvicorn

    from llmjax.serve import server

    for name in ("Config", "Server"):  # build the router, serve nothing (uvicorn's Config sets up logging)
        monkeypatch.setattr(uvicorn, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(server, "run_until_stopped", lambda _: None)
    main(["router", "--workers", "http://127.0.0.1:9", "--host", "0.0.0.0", "--port", "8"])
    assert "warning: serving on 0.0.0.0 with a router that checks no API key" in capsys.readouterr().err
    main(["router", "--workers", "http://127.0.0.1:9", "--port", "8"])
    assert "warning" not in capsys.readouterr().err
