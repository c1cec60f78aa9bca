"""kp.vllm.engine_args and the shared compression rule (no vLLM needed; the engine itself
is tested by tests/vllm_engine in its own environment)."""

import dataclasses
import json
import typing

import pytest

import kvprune_cuda as kp
from kvprune_cuda.vllm import config, rules
from kvprune_cuda.vllm.config import engine_policy
from kvprune_cuda.vllm.support import check_engine


def test_engine_args_wire_the_hooks_and_the_policy():
    args = kp.vllm.engine_args("snapkv", 0.1, n_sink=2, window=16, kernel_size=5)
    assert args["scheduler_cls"] == "kvprune_cuda.vllm.scheduler.Scheduler"
    assert args["worker_cls"] == "kvprune_cuda.vllm.worker.CPUWorker"
    # vLLM's defaults stand: chunked prefill and prefix caching on
    assert "enable_prefix_caching" not in args and "enable_chunked_prefill" not in args
    cfg = args["additional_config"]["kvprune"]
    assert config.from_vllm_config(type("Cfg", (), {"additional_config": {"kvprune": cfg}})) \
        == kp.policy.SnapKV(0.1, 2, 16, kernel_size=5)


@pytest.mark.parametrize("kwargs, name", [
    ({"policy": "h2o"}, "policy"), ({"budget": 0.0}, "budget"), ({"budget": 1.5}, "budget"),
    ({"budget": 0}, "budget"), ({"n_sink": -1}, "n_sink"), ({"window": 0}, "window"),
    ({"kernel_size": 2.5}, "kernel_size"), ({"pool": "min"}, "pool"), ({"gqa": "avg"}, "gqa"),
    ({"kernel_size": 7, "pool_shift": 4}, "pool_shift"),
])
def test_bad_arguments_are_named(kwargs, name):
    error = TypeError if kwargs.get("kernel_size") == 2.5 else ValueError  # a wrong type
    with pytest.raises(error, match=name):
        kp.vllm.engine_args(**kwargs)


def test_kept_tokens_follow_kp_hf():
    p = engine_policy("snapkv", 0.2)  # n_sink 4 + window 32 = 36 at least
    assert rules.kept_tokens(p, 300) == 60 == p.kept_tokens(300)  # kp.policy's rule
    assert rules.kept_tokens(p, 100) == 36
    assert rules.kept_tokens(p, 36) is None and rules.kept_tokens(p, 20) is None  # nothing to evict
    assert rules.kept_tokens(engine_policy("snapkv", 50), 300) == 50
    assert rules.kept_tokens(engine_policy("full"), 300) is None
    assert rules.kept_tokens(engine_policy("streaming", 0.2, window=0), 10) == 5  # sinks + one


def test_a_pinned_prefix_is_kept_whole_and_the_budget_applies_to_the_rest():
    p = engine_policy("snapkv", 0.2)
    assert rules.kept_tokens(p, 300, pinned=0) == rules.kept_tokens(p, 300)
    assert rules.kept_tokens(p, 300, pinned=128) == 128 + 36  # 172 own tokens: 34 < 36
    assert rules.kept_tokens(p, 628, pinned=128) == 128 + 100
    assert rules.kept_tokens(p, 160, pinned=128) is None      # 32 own tokens: all kept
    assert rules.kept_tokens(p, 128, pinned=128) is None
    assert rules.compresses(p, 128, 172, 300, pinned=128) == 164
    # kp.hf's policy that keeps what the engine keeps: the pinned tokens as sinks
    q = rules.with_pinned(p, 164, 128)
    assert (q.budget, q.n_sink, q.window) == (164, 128, 32) and q.kept_tokens(300) == 164
    assert rules.with_pinned(p, 60, 0) == engine_policy("snapkv", 60)


def test_the_step_of_the_last_prompt_token_compresses():
    p = engine_policy("snapkv", 0.2)
    assert rules.compresses(p, 0, 300, 300) == 60        # the whole prompt in one step
    assert rules.compresses(p, 0, 256, 300) is None      # an earlier chunk ...
    assert rules.records(p, 0, 256, 300)                 # ... records its window queries
    assert rules.compresses(p, 256, 44, 300) == 60       # the last chunk compresses
    assert not rules.records(p, 256, 44, 300)
    assert rules.compresses(p, 300, 1, 300) is None      # decoding
    assert not rules.records(p, 300, 1, 300)
    # a preempted request recomputes prompt + outputs: it stays dense, records nothing
    assert rules.compresses(p, 0, 305, 300, num_output=5) is None
    assert rules.compresses(p, 256, 44, 300, num_output=5) is None
    assert not rules.records(p, 0, 256, 300, num_output=5)
    # nothing to evict, or nothing to observe: nothing recorded
    assert not rules.records(p, 0, 20, 36) and rules.compresses(p, 20, 16, 36) is None
    assert not rules.records(engine_policy("streaming", 0.2), 0, 256, 300)


def test_missing_config_is_explained():
    class Cfg:
        additional_config = {}

    with pytest.raises(ValueError, match="additional_config"):
        config.from_vllm_config(Cfg())


def test_unsupported_vllm_versions_are_refused():
    kp.vllm.check_vllm_version("0.32.0")
    kp.vllm.check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="0.33.1"):
        kp.vllm.check_vllm_version("0.33.1")


def test_the_decode_rule_reaches_the_engine_with_its_own_options():
    args = kp.vllm.engine_args("full", decode="snapkv", max_held=64, interval=32,
                               kernel_size=3, pool="avg", gqa="max")
    cfg = type("Cfg", (), {"additional_config": args["additional_config"]})
    rule = config.decode_from_vllm_config(cfg)
    assert rule == kp.policy.make_decode("snapkv", 64, 32, kernel_size=3, pool="avg", gqa="max")
    assert (rule.policy.kernel_size, rule.policy.pool, rule.policy.gqa) == (3, "avg", "max")
    assert config.decode_from_vllm_config(
        type("Cfg", (), {"additional_config": kp.vllm.engine_args()["additional_config"]})) is None


def test_a_policy_instance_keeps_its_options():
    """Options left out keep the instance's (kernel 15 stays 15, budget 0.1 stays 0.1); given
    ones replace them; the decode rule takes the prompt policy's options."""
    cfg = lambda args: config.from_vllm_config(  # noqa: E731
        type("Cfg", (), {"additional_config": args["additional_config"]}))
    p = kp.policy.SnapKV(0.1, kernel_size=15)
    assert cfg(kp.vllm.engine_args(p)) == p
    assert cfg(kp.vllm.engine_args(p, 0.3)) == kp.policy.SnapKV(0.3, kernel_size=15)
    rule = kp.vllm.engine_args(p, decode="snapkv", max_held=256, interval=64)
    assert rule["additional_config"]["kvprune"]["decode"]["kernel_size"] == 15


@dataclasses.dataclass(frozen=True)
class Wider(kp.policy.SnapKV):
    """A user's policy at the top level of an importable module: kp.vllm runs it."""
    name: typing.ClassVar[str] = "snapkv-wider"


def test_a_policy_class_travels_by_module_path():
    args = kp.vllm.engine_args(Wider(0.1, kernel_size=15))
    cfg = args["additional_config"]["kvprune"]
    assert cfg["class"] == "test_vllm_args:Wider" and cfg["policy"] == "snapkv-wider"
    got = config.from_vllm_config(type("Cfg", (), {"additional_config": {"kvprune": cfg}}))
    assert type(got) is Wider and got == Wider(0.1, kernel_size=15)
    assert "snapkv-wider" in kp.policy.registered()  # the process that rebuilt it knows it


def test_a_policy_vllm_cannot_import_is_refused():
    """Every vLLM process imports the policy's class by its module path: a class defined in a
    function, or one whose module a process cannot import, is refused by name."""
    class Mine(kp.policy.SnapKV):
        name: typing.ClassVar[str] = "mine"

    with pytest.raises(ValueError, match="policy: .*inside a function"):
        kp.vllm.engine_args(Mine())
    cfg = {**kp.vllm.engine_args("snapkv")["additional_config"]["kvprune"],
           "class": "no_such_module:Policy"}
    with pytest.raises(ValueError, match="policy: this vLLM process cannot import"):
        config.from_vllm_config(type("Cfg", (), {"additional_config": {"kvprune": cfg}}))


def test_policies_whose_evidence_the_engine_lacks_are_refused():
    for name, evidence in (("h2o", "attention"), ("kvzip", "reconstruction")):
        with pytest.raises(ValueError, match=f"policy: '{name}' scores by '{evidence}'"):
            kp.vllm.engine_args(name)


def test_speculative_decoding_beyond_ngram_prompt_compression_is_refused():
    def cfg(method, **decode):
        args = kp.vllm.engine_args("snapkv", 0.2, **decode)
        c = type("Cfg", (), {"additional_config": args["additional_config"],
                             "speculative_config": type("Spec", (), {"method": method})})
        return c, config.decode_from_vllm_config(c)

    check_engine(*cfg("ngram"))
    for method in ("eagle", "draft_model", "mtp"):
        with pytest.raises(NotImplementedError, match="speculative_config: .*'ngram'"):
            check_engine(*cfg(method))
    with pytest.raises(NotImplementedError, match="speculative_config: .*decode-time rule"):
        check_engine(*cfg("ngram", decode="streaming", max_held=64, interval=32))


def test_server_args_are_engine_args_as_flags():
    args = kp.vllm.engine_args("snapkv", 0.16, kernel_size=15, decode="h2o", max_held=256,
                               interval=64)
    flags = kp.vllm.server_args("snapkv", 0.16, kernel_size=15, decode="h2o", max_held=256,
                                interval=64)
    assert flags == ["--scheduler-cls", "kvprune_cuda.vllm.scheduler.Scheduler",
                     "--worker-cls", "kvprune_cuda.vllm.worker.CPUWorker",
                     "--additional-config", json.dumps(args["additional_config"])]


def test_serve_builds_vllms_server_command():
    from kvprune_cuda.vllm.serve import vllm_argv

    argv = vllm_argv(["m", "--kv-budget", "0.16", "--kv-window", "16", "--port", "8001",
                      "--enforce-eager"])
    assert argv[:5] == ["--model", "m", "--port", "8001", "--enforce-eager"]
    assert argv[5:] == kp.vllm.server_args("snapkv", 0.16, window=16)
    assert vllm_argv(["m", "--kv-budget", "512"])[2:] == kp.vllm.server_args("snapkv", 512)
    assert vllm_argv(["m", "--kv-kernel-size", "31", "--kv-pool-shift", "0"])[2:] == \
        kp.vllm.server_args("snapkv", kernel_size=31, pool_shift=0)
    with pytest.raises(SystemExit, match="--worker-cls"):
        vllm_argv(["m", "--worker-cls", "x.Y"])
    with pytest.raises(SystemExit, match="MODEL comes first"):  # not --model float32
        vllm_argv(["--dtype", "float32", "m"])
    with pytest.raises(ValueError, match="budget"):
        vllm_argv(["m", "--kv-budget", "1.5"])


def test_the_default_pool_and_its_shift_reach_the_engine():
    cfg = kp.vllm.engine_args("snapkv", 0.16, pool_shift=8)["additional_config"]
    p = config.from_vllm_config(type("Cfg", (), {"additional_config": cfg}))
    assert (p.kernel_size, p.shift) == (49, 8) and p == kp.policy.SnapKV(0.16, pool_shift=8)
    cfg = kp.vllm.engine_args("snapkv", 0.16)["additional_config"]
    assert config.from_vllm_config(type("Cfg", (), {"additional_config": cfg})).shift == 16


def test_the_prefill_bound_reaches_the_engine_and_the_server():
    args = kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=4096)
    cfg = type("Cfg", (), {"additional_config": args["additional_config"]})
    assert config.prefill_from_vllm_config(cfg) == kp.policy.PrefillBound(
        kp.policy.SnapKV(0.16), 4096)
    assert config.from_vllm_config(cfg) == kp.policy.SnapKV(0.16)
    assert config.prefill_from_vllm_config(
        type("Cfg", (), {"additional_config": kp.vllm.engine_args()["additional_config"]})) is None
    from kvprune_cuda.vllm.serve import vllm_argv

    assert vllm_argv(["m", "--kv-prefill-max-held", "4096", "--kv-budget", "0.16"])[2:] == \
        kp.vllm.server_args("snapkv", 0.16, prefill_max_held=4096)
    with pytest.raises(ValueError, match="prefill_max_held: policy 'streaming'"):
        kp.vllm.engine_args("streaming", 0.16, prefill_max_held=4096)
    with pytest.raises(ValueError, match="prefill_max_held must be an int >= 1"):
        kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=0)
    window = kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=4096, prefill_signal="window")
    assert config.prefill_from_vllm_config(
        type("Cfg", (), {"additional_config": window["additional_config"]})).signal == "window"
    assert vllm_argv(["m", "--kv-prefill-max-held", "64", "--kv-prefill-signal", "window"])[2:] \
        == kp.vllm.server_args("snapkv", prefill_max_held=64, prefill_signal="window")
    with pytest.raises(ValueError, match="prefill_signal must be one of"):
        kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=64, prefill_signal="sum")
    with pytest.raises(ValueError, match="prefill_signal: given without prefill_max_held"):
        kp.vllm.engine_args("snapkv", 0.16, prefill_signal="max")
    novel = kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=4096, prefill_signal="far",
                                prefill_novelty=0.5)
    assert config.prefill_from_vllm_config(
        type("Cfg", (), {"additional_config": novel["additional_config"]})) == \
        kp.policy.PrefillBound(kp.policy.SnapKV(0.16), 4096, "far", 0.5)
    assert vllm_argv(["m", "--kv-prefill-max-held", "64", "--kv-prefill-novelty", "0.25"])[2:] \
        == kp.vllm.server_args("snapkv", prefill_max_held=64, prefill_novelty=0.25)
    with pytest.raises(ValueError, match="prefill_novelty: .*'window'"):
        kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=64, prefill_signal="window",
                            prefill_novelty=0.5)
    with pytest.raises(ValueError, match="prefill_novelty: given without prefill_max_held"):
        kp.vllm.engine_args("snapkv", 0.16, prefill_novelty=0.5)
    with pytest.raises(ValueError, match="prefill_signal: 'reconstruct' .*vLLM's scheduler"):
        kp.vllm.engine_args("snapkv", 0.16, prefill_max_held=64, prefill_signal="reconstruct")
    hand_made = {config.CONFIG_KEY: {**novel["additional_config"][config.CONFIG_KEY],
                                     "prefill_signal": "reconstruct"}}  # around engine_args
    with pytest.raises(ValueError, match="prefill_signal: 'reconstruct'"):
        config.prefill_from_vllm_config(type("Cfg", (), {"additional_config": hand_made}))


def test_a_bounded_prefill_compresses_each_earlier_chunk_over_the_bound():
    """A 1000-token prompt in chunks of 256 under a bound of 300 (window 32, 4 sinks): the
    held counts by hand, the prompt's own compression at its last chunk only when the
    budget keeps fewer than it holds."""
    p = engine_policy("snapkv", 0.16)
    bound = kp.policy.make_prefill_bound(300, p)
    held, kept_after = 0, []
    for start in range(0, 1000, 256):
        scheduled = min(256, 1000 - start)
        held += scheduled
        kept = (rules.compresses(p, start, scheduled, 1000, 0, 0, held)
                or rules.prefill_compresses(bound, start, scheduled, 1000, held))
        kept_after.append(kept)
        held = kept or held
    # 256 (under); 300 + 256 = 556 -> 300 (x2 at 512, 768); last: 300 + 232 = 532 -> 160
    assert kept_after == [None, 300, 300, 160]
    assert rules.compresses(p, 768, 232, 1000, 0, 0, 150) is None  # the budget keeps them all
    assert bound.target(pinned=512) == 512 + 32 and bound.peak(256) == 556


def test_the_plugin_checks_a_bounded_engine_against_its_peak():
    """The start-up check's length (kvprune_cuda.vllm.plugin, no vLLM needed): the most one
    request holds, when both the prefill and the generation are bounded and that is below
    max_model_len; vLLM's own check (None) otherwise."""
    from types import SimpleNamespace

    from kvprune_cuda.vllm.plugin import bounded_length

    def engine(max_model_len=32768, original=32768, **kv):
        return SimpleNamespace(
            additional_config=kp.vllm.engine_args("snapkv", 0.16, **kv)["additional_config"],
            model_config=SimpleNamespace(max_model_len=max_model_len,
                                         original_max_model_len=original),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=2048))

    rule = dict(decode="snapkv", max_held=4096, interval=256)
    assert bounded_length(engine(prefill_max_held=4096, **rule)) == 4096 + 2048 + 256
    assert bounded_length(engine(prefill_max_held=1024, **rule)) == 4096 + 256  # the rule's
    assert bounded_length(engine(prefill_max_held=4096)) is None           # generation unbounded
    assert bounded_length(engine(**rule)) is None                          # prefill unbounded
    assert bounded_length(engine(6000, 6000, prefill_max_held=4096, **rule)) is None  # fits
    assert bounded_length(engine(32768, -1, prefill_max_held=4096, **rule)) is None  # vLLM fits
    plain = engine(prefill_max_held=4096, **rule)
    plain.additional_config = {}
    assert bounded_length(plain) is None


def test_a_resumed_requests_replay_is_bounded_up_to_vllms_prefill_end():
    """A request preempted after 300 outputs replays 1000 + 299 tokens (vLLM's prefill end:
    the last output's KV is the next step's): every replay chunk ending before that is
    bounded, the chunk crossing the prompt's end included (the prompt's own compression does
    not apply to a resumed request)."""
    p = engine_policy("snapkv", 0.16)
    bound = kp.policy.make_prefill_bound(300, p)
    assert rules.prefill_end(1000, 0) == 1000 and rules.prefill_end(1000, 300) == 1299
    assert rules.compresses(p, 768, 256, 1000, 300, 0, 556) is None
    assert rules.prefill_compresses(bound, 768, 256, 1000, 556, 0, 300) == 300  # crosses 1000
    assert rules.prefill_compresses(bound, 1024, 256, 1000, 556, 0, 300) == 300
    assert rules.prefill_compresses(bound, 1280, 19, 1000, 319, 0, 300) is None  # the last
    assert rules.prefill_compresses(bound, 768, 232, 1000, 532) is None  # a prompt's last chunk
