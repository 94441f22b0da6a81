"""`shard-coord serve`'s flags are derived from CoordConfig, which composes the component
configs: guards that the flags stay the ones users know, that each default is the
component's own (one home per fact), and that each parsed value lands in its component."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from coordinator.cli import build_parser, main
from coordinator.config import CoordConfig
from coordinator.gateway.api import ApiConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed, peer_id_of
from shard.options import config_from_args

# The flags `shard-coord serve` has always had (README, docs, scripts/demo.sh use them).
FLAGS = {"--model", "--store-dir", "--listen", "--http", "--key-path", "--local-nodes", "--min-nodes", "--wire-dtype",
         "--aux-dtype", "--link-latency-ms", "--link-upload-mbps", "--link-jitter-ms", "--draft", "--eagle-head",
         "--eagle-tree", "--pipeline-depth", "--prefill-chunk-tokens", "--prefill-edge-chunk-tokens",
         "--max-concurrent-jobs", "--max-queued-jobs", "--queue-timeout-s", "--node-threads", "--node-batch-token-budget",
         "--node-prefill-order", "--trusted-nodes", "--unverified-newcomers",
         "--receipts-dir", "--recent-bundles-mb", "--max-rings", "--ring-spares", "--drain-s", "--kv-wait-s", "--burst-wait-ms",
         "--max-groups", "--group-wait-ms", "--prefix-cache-tokens",
         "--audit-rate", "--log-level", "--ring-wait-s",
         "--api-keys", "--key-max-concurrent-jobs", "--key-tokens-per-minute", "--public-health", "--public-status", "--trusted-peers",
         "--public-metrics", "--local-selector-split", "--node-quant", "--max-body-bytes", "--body-timeout-s",
         "--header-timeout-s", "--probation-rounds"}


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _parse(*argv: str) -> CoordConfig:
    return config_from_args(CoordConfig, build_parser().parse_args(["serve", *argv]))


def test_serve_keeps_its_flags_each_with_help_and_one_default():
    # Bug guarded: a component field becoming a flag by accident (or a flag vanishing) when
    # the config is recomposed; "(default: X) (default: None)" from help and the deriver both
    # naming a default. Sound: every option string of the real parser is compared.
    actions = [a for a in _serve_parser()._actions if a.option_strings and a.dest != "help"]
    assert {a.option_strings[0] for a in actions} == FLAGS
    for action in actions:
        assert action.help and action.help.count("(default:") == 1, action.option_strings


def test_no_flags_give_the_component_defaults():
    config = _parse()
    assert config == CoordConfig()
    assert (config.engine, config.swarm, config.api, config.receipts, config.audit) == (
        EngineConfig(), SwarmConfig(), ApiConfig(), ReceiptConfig(), AuditConfig())


def test_help_shows_each_component_default():
    help_text = " ".join(_serve_parser().format_help().split())
    assert f"(1 = no pipelining) (default: {EngineConfig().max_pipeline_depth})" in help_text
    assert f"cost in docs/receipts.md (default: {AuditConfig().rate})" in help_text
    assert f"get 429 (default: {ApiConfig().max_concurrent_jobs})" in help_text
    assert f"(default: {ApiConfig().host}:{ApiConfig().port})" in help_text
    assert "activation dtype on the wire (default: f32)" in help_text


def test_parsed_values_land_in_their_components():
    config = _parse("--wire-dtype", "fp8", "--aux-dtype", "bf16", "--eagle-tree", "8,3", "--pipeline-depth", "2",
                    "--audit-rate", "0.5", "--max-concurrent-jobs", "3", "--receipts-dir", "/r", "--draft", "ngram",
                    "--link-latency-ms", "20", "--prefill-chunk-tokens", "128", "--min-nodes", "3", "--model", "m")
    assert config.swarm == SwarmConfig(wire_dtype="f8_e4m3fn", aux_dtype="bf16")  # CLI name -> table name
    assert config.engine == EngineConfig(eagle_tree=(8, 3), max_pipeline_depth=2, draft="ngram", link_latency_ms=20.0,
                                         prefill_chunk_tokens=128)
    assert config.audit == AuditConfig(rate=0.5)
    assert config.api == ApiConfig(max_concurrent_jobs=3)
    assert config.receipts == ReceiptConfig(receipts_dir="/r")
    assert (config.min_nodes, config.model) == (3, "m")


def test_trusted_nodes_and_the_unverified_newcomers_policy_parse_or_exit_2(capsys):
    # Bug guarded: a mistyped trusted key accepted (it would silently trust nobody) or the
    # policy taking a value the release gate does not know.
    peer = peer_id_of(keypair_from_seed(bytes(32)))
    config = _parse("--trusted-nodes", f"{peer}, {peer}", "--unverified-newcomers", "refuse")
    assert config.engine.trusted_nodes == (peer, peer) and config.engine.unverified_newcomers == "refuse"
    assert _parse().engine == EngineConfig() and EngineConfig().unverified_newcomers == "serve"
    assert main(["serve", "--trusted-nodes", f"{peer},12D3KooWtypo"]) == 2
    assert capsys.readouterr().err == ("shard-coord serve: error: --trusted-nodes takes comma-separated Ed25519 peer ids "
                                       "(12D3KooW...), got '12D3KooWtypo'\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--unverified-newcomers", "maybe"])


def test_a_component_field_without_an_option_is_no_flag():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--frame-timeout-s", "3"])
    assert not any("--planner" in a.option_strings for a in _serve_parser()._actions)


@pytest.mark.parametrize("argv,message", [
    (["--eagle-tree", "8"], "--eagle-tree takes NODES,DEPTH (two integers), got '8'"),
    (["--pipeline-depth", "9"], "pipeline depth (rounds in flight) must be 1..8, got 9"),
    (["--eagle-tree", "2,3"], "eagle_tree (nodes, depth) needs 1 <= depth <= nodes <= 256, got (2, 3)"),
])
def test_values_the_configs_refuse_exit_2_before_anything_loads(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err == f"shard-coord serve: error: {message}\n"


def test_a_wire_dtype_not_on_the_cli_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--wire-dtype", "f8_e4m3fn"])
    assert "invalid choice: 'f8_e4m3fn' (choose from 'f32', 'f16', 'bf16', 'fp8')" in capsys.readouterr().err


def test_assembly_derives_what_one_component_takes_from_another():
    from coordinator.assembly import assembled

    config = assembled(_parse("--local-nodes", "3", "--link-latency-ms", "20", "--prefill-chunk-tokens", "128"))
    assert config.swarm.min_nodes == 3
    assert config.swarm.topology.prefill_chunk_tokens == 128
    assert config.swarm.topology.coordinator_link_latency_s == pytest.approx(0.020)
    assert assembled(_parse("--local-nodes", "3", "--min-nodes", "2")).swarm.min_nodes == 2
    assert assembled(_parse()).swarm.min_nodes == 1
    # --local-nodes N is an N-stage ring (issue 23: loopback's selector seated all 30 layers on
    # one node); --local-selector-split and volunteer swarms keep the selector.
    assert config.swarm.planner == "all_nodes"
    assert assembled(_parse("--local-nodes", "3", "--local-selector-split")).swarm.planner == "select_ring"
    assert assembled(_parse("--local-nodes", "1")).swarm.planner == assembled(_parse()).swarm.planner == "select_ring"


def test_the_open_jobs_cap_every_assignment_carries_serves_the_gateway():
    # Bug guarded (issue 20): a gateway run with --max-concurrent-jobs past the nodes'
    # 128 open jobs failed jobs until every volunteer raised --max-open-jobs. Sound: the
    # cap assembled follows the gateway (two per concurrent generation), never drops
    # below a node's 128, stays within what the wire carries, and a cap a caller set
    # on the swarm is kept.
    from coordinator.assembly import assembled, open_jobs_per_stage
    from shard.wire.limits import MAX_OPEN_JOBS

    assert assembled(_parse()).swarm.max_open_jobs == 128
    assert assembled(_parse("--max-concurrent-jobs", "300")).swarm.max_open_jobs == 600
    assert open_jobs_per_stage(ApiConfig(max_concurrent_jobs=10**6)) == MAX_OPEN_JOBS
    kept = dataclasses.replace(_parse(), swarm=dataclasses.replace(_parse().swarm, max_open_jobs=7))
    assert assembled(kept).swarm.max_open_jobs == 7
