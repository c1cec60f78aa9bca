"""kp.policy.SnapKV's forward-shifted pool, by hand; its fused selection (kp.snapkv) for every
shift; kp.policy.KVzip's optional pool of its recorded maxima; which recordings a policy can rank."""

import pytest
import torch

import kvprune_cuda as kp
from kvprune_cuda.policy import snapkv as snapkv_module


def _score_of(monkeypatch, votes: list, **options) -> list:
    """SnapKV(**options).score with the window's votes replaced by ``votes`` (one row)."""
    s = torch.tensor(votes, dtype=torch.float32).view(1, 1, -1)
    monkeypatch.setattr(snapkv_module, "window_scores", lambda *a, **k: s.clone())
    p = kp.policy.SnapKV(**options)
    return p.score(None, torch.zeros(1, 1, len(votes), 4))[0, 0].tolist()


@pytest.mark.parametrize("shift, reached", [(0, [2, 3, 4, 5, 6]), (1, [3, 4, 5, 6, 7]),
                                            (2, [4, 5, 6, 7, 8])])
def test_a_vote_reaches_r_plus_shift_tokens_after_it(monkeypatch, shift, reached):
    # one vote at position 4 of 14, window 2 (positions 12, 13 copied), kernel 5 (r = 2):
    # it reaches the tokens in [4 - r + shift, 4 + r + shift]
    votes = [0.0] * 14
    votes[4] = 1.0
    got = _score_of(monkeypatch, votes, budget=6, n_sink=0, window=2, kernel_size=5,
                    pool_shift=shift)
    assert [i for i, x in enumerate(got[:12]) if x == 1.0] == reached


def test_the_shifted_pool_keeps_each_token_s_largest_reaching_vote(monkeypatch):
    votes = [0.1, 0.2, 0.9, 0.1, 0.1, 0.1, 0.1, 0.3, 0.1, 0.8, 0.5, 0.6]
    # kernel 3 (r = 1), shift 1: token i < 10 takes max(votes[i - 2], votes[i - 1], votes[i]);
    # the votes of the window (positions 10, 11) are not pooled, the last prefix vote (9) is
    got = _score_of(monkeypatch, votes, budget=6, n_sink=0, window=2, kernel_size=3,
                    pool_shift=1)
    want = [0.1, 0.2, 0.9, 0.9, 0.9, 0.1, 0.1, 0.3, 0.3, 0.8]
    assert got[:10] == pytest.approx(want)


def test_a_shift_longer_than_the_row_keeps_its_shape(monkeypatch):
    got = _score_of(monkeypatch, [0.5] * 20, budget=10, n_sink=0, window=2, kernel_size=101,
                    pool_shift=50)
    assert len(got) == 20 and got[:18] == pytest.approx([0.5] * 18)


@pytest.mark.parametrize("options", [dict(pool_shift=0), dict(kernel_size=7, pool_shift=2),
                                     dict(), dict(pool="avg", gqa="max")])
def test_every_shift_selects_fused_what_its_score_ranks(options):
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    p = kp.policy.SnapKV(budget=60, window=8, **options)
    fused = p.select(q, k, v, 60)
    assert fused is not None
    idx = kp.select_keep(p.score(q, k), 60, n_sink=p.n_sink, window=p.window)
    assert torch.equal(fused.idx, idx)
    assert all(torch.equal(a, b) for a, b in zip(fused[:2], kp.gather_kv(k, v, idx)))


def test_pool_shift_is_validated():
    with pytest.raises(ValueError, match="pool_shift"):
        kp.policy.SnapKV(kernel_size=7, pool_shift=4)
    with pytest.raises(ValueError, match="pool_shift"):
        kp.policy.SnapKV(pool_shift=-1)
    # left None: 16 with the default kernel (49), else 0 (the centred pools of before)
    assert [kp.policy.SnapKV(kernel_size=n).shift for n in (1, 7, 31, 49)] == [0, 0, 0, 16]
    assert kp.policy.SnapKV().kernel_size == 49 and kp.policy.SnapKV().shift == 16


def test_kvzip_ranks_its_maxima_as_recorded_unless_it_pools_them():
    recorded = torch.tensor([0.1, 0.2, 0.9, 0.1, 0.1, 0.1, 0.1, 0.3, 0.1, 0.8]).view(1, 1, -1)
    raw = dict(head_floor=0.0)  # no reservation: the maxima as recorded / pooled
    assert kp.policy.KVzip(**raw).rank_recorded(recorded) is recorded  # kernel_size 1: unpooled
    # kernel 3 (r = 1), shift 1, window 0: token i takes max(s[i - 2], s[i - 1], s[i])
    got = kp.policy.KVzip(kernel_size=3, pool_shift=1, **raw).rank_recorded(recorded)[0, 0].tolist()
    assert got == pytest.approx([0.1, 0.2, 0.9, 0.9, 0.9, 0.1, 0.1, 0.3, 0.3, 0.8])
    # centred: max(s[i - 1], s[i], s[i + 1])
    got = kp.policy.KVzip(kernel_size=3, **raw).rank_recorded(recorded)[0, 0].tolist()
    assert got == pytest.approx([0.2, 0.9, 0.9, 0.9, 0.1, 0.1, 0.3, 0.3, 0.8, 0.8])
    with pytest.raises(ValueError, match="pool_shift"):
        kp.policy.KVzip(kernel_size=3, pool_shift=2)
    with pytest.raises(TypeError, match="kernel_size"):
        kp.policy.KVzip(kernel_size=3.0)


def test_kvzip_head_floor_reserves_each_heads_own_largest_maxima():
    # two heads of 8 keys, 4 tokens each with no sinks (8 shared under the "head" scope); every
    # maximum of head 0 beats head 1's, so without a floor head 0 takes all 8
    recorded = torch.tensor([[[0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55],
                              [0.05, 0.3, 0.1, 0.2, 0.0, 0.01, 0.02, 0.03]]])
    plain = kp.policy.KVzip(budget=4, n_sink=0, head_floor=0.0).rank_recorded(recorded)
    assert kp.head_budgets([plain], 4, n_sink=0, window=0).view(-1).tolist() == [8, 0]
    # a floor of 0.5: each head's own two largest maxima raised by 1, so head 1 keeps two
    p = kp.policy.KVzip(budget=4, n_sink=0, head_floor=0.5)
    want = torch.tensor([[[1.9, 1.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55],
                          [0.05, 1.3, 0.1, 1.2, 0.0, 0.01, 0.02, 0.03]]])
    got = p.rank_recorded(recorded)
    assert torch.allclose(got, want)
    assert kp.head_budgets([got], 4, n_sink=0, window=0).view(-1).tolist() == [6, 2]
    # with novelty as well: the floor's keys and each head's most novel key (the opposite one)
    keys = torch.tensor([[1.0, 0.0]] * 7 + [[-1.0, 0.0]]).view(1, 1, 8, 2).expand(1, 2, 8, 2)
    both = kp.policy.KVzip(budget=4, n_sink=0, head_floor=0.5, novelty=0.25).rank_recorded(
        recorded, keys)
    assert torch.allclose(both, want + torch.tensor([0.0] * 7 + [1.0]))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="head_floor"):
            kp.policy.KVzip(head_floor=bad)
    with pytest.raises(TypeError, match="head_floor"):
        kp.policy.KVzip(head_floor="half")


def test_key_novelty_is_minus_the_cosine_to_the_heads_mean_direction():
    # three keys along x, one along y: the mean unit key is (0.75, 0.25), direction (3, 1)/sqrt(10)
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [0.0, 3.0]]).view(1, 1, 4, 2)
    got = kp.policy.novelty.key_novelty(keys)[0, 0].tolist()
    x, y = -3 / 10 ** 0.5, -1 / 10 ** 0.5
    assert got == pytest.approx([x, x, x, y])
    # a key opposite to the others: the mean direction is theirs, novelty 1 against -1
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]]).view(1, 1, 4, 2)
    assert kp.policy.novelty.key_novelty(keys)[0, 0].tolist() == pytest.approx([-1, -1, -1, 1])


def test_kvzip_novelty_reserves_a_share_of_the_budget_for_the_most_novel_keys():
    recorded = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.0, 0.0, 0.0]).view(1, 1, -1)
    # six keys along x, one along y and one opposite: the last two are the most novel
    keys = torch.tensor([[1.0, 0.0]] * 6 + [[0.0, 1.0], [-1.0, 0.0]]).view(1, 1, 8, 2)
    p = kp.policy.KVzip(budget=4, n_sink=0, head_floor=0.0, novelty=0.5)  # 4 kept, 2 the most novel
    got = p.rank_recorded(recorded, keys)
    assert got.topk(4, -1).indices[0, 0].sort().values.tolist() == [0, 1, 6, 7]
    assert got[0, 0, :6].tolist() == pytest.approx(recorded[0, 0, :6].tolist())  # the rest as recorded
    assert p.rank_recorded(recorded, keys).topk(2, -1).indices[0, 0].sort().values.tolist() == [6, 7]
    # novelty 0: the maxima alone; the keys are not needed
    assert kp.policy.KVzip(budget=4, n_sink=0, head_floor=0.0).rank_recorded(recorded) is recorded
    with pytest.raises(ValueError, match="keys"):
        p.rank_recorded(recorded)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="novelty"):
            kp.policy.KVzip(novelty=bad)
    for bad in (True, "half"):  # a wrong type: a TypeError, as for every option
        with pytest.raises(TypeError, match="novelty"):
            kp.policy.KVzip(novelty=bad)


def test_evidence_mismatch_names_what_keeps_a_policy_from_ranking_a_recording():
    """Only an evidence kind or a recording option (kvzip's weight, h2o's gqa) stops a policy
    from ranking what another recorded; a ranking option (window, head_floor) does not."""
    kvzip, h2o, snapkv = (kp.policy.make(n) for n in ("kvzip", "h2o", "snapkv"))
    assert kvzip.evidence_mismatch(kp.policy.make("kvzip", window=32, head_floor=0.5)) is None
    assert kp.policy.make("kvzip", weight="none").evidence_mismatch(kvzip) == "weight"
    assert kp.policy.make("kvzip", chunk_size=7, n_sink=1).evidence_mismatch(kvzip) == "chunk_size"
    assert kp.policy.make("h2o", gqa="max").evidence_mismatch(h2o) == "gqa"
    assert kvzip.evidence_mismatch(h2o) == "evidence" and h2o.evidence_mismatch(snapkv) == "evidence"
    assert snapkv.evidence_mismatch(kp.policy.make("snapkv", kernel_size=7)) is None


def _max_probability_by_hand(q, k, far):
    """fp64 [B, Hkv, n]: each key's largest softmax probability over the query heads of its KV
    head and the queries (the last T positions of n) at least ``far`` positions after it,
    each query normalised over the keys at least ``far`` before it; 0 where none counts."""
    b, hq, t, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for h in range(hq):
        kh = k[:, h // (hq // hkv)].double()  # [B, n, D]
        for i in range(t):
            last = n - t + i - far  # the last key this query counts for
            if last < 0:
                continue
            logits = (kh[:, :last + 1] @ q[:, h, i].double()[..., None])[..., 0] / d ** 0.5
            g = h // (hq // hkv)
            out[:, g, :last + 1] = torch.maximum(out[:, g, :last + 1], logits.softmax(-1))
    return out


def test_the_prefill_bounds_far_signal_counts_the_queries_window_or_more_after_a_key():
    policy = kp.policy.make("snapkv", kp.policy.Options(n_sink=2, window=3, kernel_size=1))
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 6, 8, generator=gen), torch.randn(1, 2, 10, 8, generator=gen)
    far = kp.policy.make_prefill_bound(8, policy, "far")
    near = kp.policy.make_prefill_bound(8, policy, "max")
    assert (far.far, near.far, far.carries, near.carries) == (3, 0, True, True)
    got_far, got_near = far.scores(q, k), near.scores(q, k)
    torch.testing.assert_close(got_far.double(), _max_probability_by_hand(q, k, 3))
    torch.testing.assert_close(got_near.double(), _max_probability_by_hand(q, k, 0))
    assert not torch.allclose(got_far, got_near)
    assert got_far[..., -3:].abs().sum() == 0  # no query is 3 after the last 3 keys
    # a chunk shorter than the distance still counts for the held keys far enough before it;
    # keys no more than the distance in all get nothing
    torch.testing.assert_close(far.scores(q[:, :, :2], k).double(),
                               _max_probability_by_hand(q[:, :, :2], k, 3))
    assert far.scores(q[:, :, :2], k[:, :, :3]).abs().sum() == 0
    # a chunk longer than the keys 3 before its end: its first queries count for none
    torch.testing.assert_close(far.scores(q, k[:, :, :8]).double(),
                               _max_probability_by_hand(q, k[:, :, :8], 3))
    assert not kp.policy.make_prefill_bound(8, policy, "window").carries
    recon = kp.policy.make_prefill_bound(8, policy, "reconstruct")
    assert (recon.carries, recon.in_forward, far.in_forward) == (True, False, True)
    # held after a chunk of 4, plus its repetition (4 tokens and 3 of prompt); 8 + 4 otherwise
    assert (recon.peak(4, repeat=3), far.peak(4, repeat=3)) == (8 + 4 + 4 + 3, 8 + 4)
    assert recon.scorer == kp.policy.KVzip(n_sink=2)  # KVzip+'s chunk softmax, the sinks


def test_the_prefill_bounds_novelty_reserve_keeps_the_keys_unlike_their_head_first():
    """Keys 5 (against the others) and 7 (across them) are the most novel of a head whose keys
    all point along e1 but for the sink 0 and the window's 11, as novel as 5 (kept anyway, so
    not reserved); the running maxima favour keys 3 and 4. Kept by hand: the sink 0, the
    window 10-11, then int(novelty x 5) novel keys (at most the 2 slots left), then the
    maxima."""
    policy = kp.policy.make("snapkv", kp.policy.Options(n_sink=1, window=2, kernel_size=1))
    keys = torch.zeros(1, 1, 12, 4)
    keys[..., 0] = 1.0
    keys[0, 0, :, 1] = torch.linspace(-0.1, 0.1, 12)  # not all alike, none novel
    keys[0, 0, 5] = keys[0, 0, 0] = keys[0, 0, 11] = torch.tensor([-1.0, 0.0, 0.0, 0.0])
    keys[0, 0, 7] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    scores = torch.full((1, 1, 12), 0.01)
    scores[0, 0, 3], scores[0, 0, 4] = 0.5, 0.4
    kept = lambda novelty: kp.policy.make_prefill_bound(  # noqa: E731
        8, policy, "far", novelty).select(scores, 5, keys=keys)[0, 0].tolist()
    assert kept(None) == [0, 3, 4, 10, 11]
    assert kept(0.2) == [0, 3, 5, 10, 11]
    assert kept(0.4) == kept(1.0) == [0, 5, 7, 10, 11]
    with pytest.raises(ValueError, match="keys: prefill_novelty"):
        kp.policy.make_prefill_bound(8, policy, "max", 0.5).select(scores, 5)
    with pytest.raises(ValueError, match="prefill_novelty: .*'window'"):
        kp.policy.make_prefill_bound(8, policy, "window", 0.5)
    with pytest.raises(ValueError, match="prefill_novelty: given without prefill_max_held"):
        kp.policy.make_prefill_bound(None, policy, None, 0.5)
    with pytest.raises(ValueError, match="prefill_novelty must be in"):
        kp.policy.make_prefill_bound(8, policy, "far", 1.5)
