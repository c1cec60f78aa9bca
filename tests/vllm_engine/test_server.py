"""vLLM's OpenAI server as operators start it, with kvprune_cuda's flags, over real HTTP.

``python -m vllm.entrypoints.openai.api_server`` with ``kp.vllm.server_args(...)`` and vLLM's
defaults otherwise: torch.compile (the CPU backend's default compilation mode), the engine core
and the worker in processes of their own (VLLM_ENABLE_V1_MULTIPROCESSING unset), chunked
prefill and prefix caching. Concurrent requests over HTTP (completions and chat, streamed and
not, logprobs, n=2, a stop string, a seeded temperature, max_tokens=1); greedy tokens against
kp.hf.compress's on the same prompts (fp32); freed blocks against numbers computed by hand,
read from the server's log; once idle, every block is back in the pool; a clean shutdown.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.vllm.serve import ServerProcess  # noqa: E402
from test_engine import tiny_model  # noqa: E402

BUDGET = 0.2
NEW_TOKENS = 12
# prompt length -> (kept = round(0.2 n), blocks freed = ceil(n / 32) - ceil(kept / 32)), by hand
HAND = {300: (60, 10 - 2), 270: (54, 9 - 2), 240: (48, 8 - 2)}


def tiny_tokenizer(path) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of exactly 512 tokens (the model's vocabulary), trained here on random
    words, with a chat template: what the server needs to serve text and chat."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    g = torch.Generator().manual_seed(3)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(letters[int(i)] for i in torch.randint(0, 26, (int(n),), generator=g))
             for n in torch.randint(2, 8, (3000,), generator=g)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([" ".join(words[i:i + 30]) for i in range(0, 3000, 30)],
                            trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0],
                                                pad_token=specials[0])
    fast.add_tokens([f"<|extra_{i}|>" for i in range(512 - len(fast))])
    assert len(fast) == 512
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                          "<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_served")
    model = tiny_model()
    model.save_pretrained(path)
    tok = tiny_tokenizer(path)
    return str(path), model.eval(), tok


def post(port, route, body, stream=False):
    """The JSON answer (or, streamed, the list of JSON events) of one HTTP request."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        if not stream:
            return json.loads(resp.read())
        events = []
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return events


def hf_compressed(model, prompt, max_tokens=NEW_TOKENS):
    """kp.hf.compress's greedy tokens for ``prompt`` (token ids): the yardstick."""
    with kp.hf.compress(model, policy="snapkv", budget=BUDGET):
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def ids(tokens):
    """Token ids out of ``return_tokens_as_token_ids`` strings ("token_id:123")."""
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_openai_server_default_mode_matches_kp_hf_and_frees_blocks(served_model, tmp_path):
    model_dir, model, tok = served_model
    g = torch.Generator().manual_seed(5)
    prompts = {n: torch.randint(3, 512, (n,), generator=g).tolist() for n in HAND}
    words = tok.decode(torch.randint(3, 400, (900,), generator=g).tolist())
    chats = [[{"role": "user", "content": words[i * 300:(i + 1) * 300]}] for i in range(2)]
    chat_ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for c in chats]
    n300 = prompts[300]

    server = ServerProcess(
        model_dir, ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len",
                    "1024", "--block-size", "32", "--seed", "0",
                    *kp.vllm.server_args("snapkv", BUDGET)],
        tmp_path / "server.log",
        env=dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1"))
    try:
        server.wait_ready()
        greedy = dict(model="tiny", max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                      logprobs=1, return_tokens_as_token_ids=True)
        chat_greedy = dict(model="tiny", max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                           logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
        jobs = {f"completion {n}": ("/v1/completions", {**greedy, "prompt": p}, False)
                for n, p in prompts.items()}
        jobs.update({
            "chat 0": ("/v1/chat/completions", {**chat_greedy, "messages": chats[0]}, False),
            "chat 1 streamed": ("/v1/chat/completions",
                                {**chat_greedy, "messages": chats[1], "stream": True}, True),
            "sampled n=2": ("/v1/completions", dict(model="tiny", prompt=n300[::-1], n=2,
                                                    max_tokens=NEW_TOKENS, temperature=0.8,
                                                    seed=7, ignore_eos=True), False),
            "max_tokens=1": ("/v1/completions", {**greedy, "prompt": n300[1:] + [7],
                                                 "max_tokens": 1}, False),
        })
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = {name: pool.submit(post, server.port, *job) for name, job in jobs.items()}
            got = {name: f.result() for name, f in futures.items()}
        # the streamed completion and the stop string, once the greedy text is known
        stream = post(server.port, "/v1/completions", {**greedy, "prompt": prompts[270],
                                                       "stream": True}, True)
        full_text = got["completion 300"]["choices"][0]["text"]
        cut = next(a for a in range(2, len(full_text) - 3)
                   if full_text.find(full_text[a:a + 3]) == a and full_text[a:a + 3].strip())
        stop = post(server.port, "/v1/completions",
                    {**greedy, "prompt": n300, "stop": [full_text[cut:cut + 3]]})
    finally:
        code = server.stop()
    log = server.text()

    # greedy tokens equal kp.hf.compress's on the same prompts
    for n, p in prompts.items():
        assert ids(got[f"completion {n}"]["choices"][0]["logprobs"]["tokens"]) == \
            hf_compressed(model, p), n
    assert ids(t for e in stream for t in e["choices"][0]["logprobs"]["tokens"]) == \
        hf_compressed(model, prompts[270])
    assert ids(c["token"] for c in got["chat 0"]["choices"][0]["logprobs"]["content"]) == \
        hf_compressed(model, chat_ids[0])
    assert ids(c["token"] for e in got["chat 1 streamed"] if e["choices"]
               and e["choices"][0].get("logprobs")
               for c in e["choices"][0]["logprobs"]["content"]) == \
        hf_compressed(model, chat_ids[1])
    assert ids(got["max_tokens=1"]["choices"][0]["logprobs"]["tokens"]) == \
        hf_compressed(model, n300[1:] + [7], 1)
    # the stop string cuts the same greedy text where it first occurs
    assert stop["choices"][0]["finish_reason"] == "stop"
    assert stop["choices"][0]["text"] == full_text[:cut]
    sampled = got["sampled n=2"]["choices"]
    assert len(sampled) == 2 and all(c["finish_reason"] == "length" for c in sampled)
    # every compression, from the server's log: the hand-computed kept counts and freed blocks
    lines = [tuple(map(int, m)) for m in re.findall(
        r"keeps (\d+) of (\d+) tokens, (\d+) blocks freed", log)]
    for n, (kept, blocks) in HAND.items():
        mine = [freed for k, of, freed in lines if (k, of) == (kept, n)]
        assert mine and set(mine) == {blocks}, (n, lines)
    # 3 completions, 2 chats, the streamed and the stopped ones; the n=2 pair shares its
    # prompt's blocks (prefix caching: shared blocks stay whole, so little or nothing is left
    # to evict); max_tokens=1 finishes in the step that compresses it, freeing every block
    assert len(lines) >= 7, lines
    # once idle, every block is back in the pool; then a clean shutdown
    idle = re.findall(r"idle: (\d+) blocks freed by compression in all; (\d+) of (\d+) "
                      r"blocks free in the pool", log)
    assert idle, log[-3000:]
    total, free, blocks = map(int, idle[-1])
    assert total >= sum(b for _, b in HAND.values()) and free == blocks
    # the workers' timing: each compressing step's share of its forward; the totals of each
    # busy period (logged when idle) hold every such step's (as rounded in the log)
    steps = [tuple(map(float, m)) for m in re.findall(
        r"step \d+ compressed \d+ request\(s\): kvprune ([\d.]+) ms of the step's ([\d.]+) "
        r"ms forward \(([\d.]+) %\)", log)]
    assert steps and all(0 < own < fwd and 0 < pct < 100 for own, fwd, pct in steps), steps
    spent = [tuple(map(float, m)) for m in re.findall(
        r"kvprune's own work took ([\d.]+) s of ([\d.]+) s of forwards", log)]
    assert spent and all(own < fwd for own, fwd in spent), spent
    assert sum(own for own, _ in spent) + 0.5e-3 * len(spent) >= \
        sum(own for own, _, _ in steps) / 1e3 - 0.005e-3 * len(steps), (spent, steps)
    assert code == 0, log[-3000:]
    print("\n".join(line for line in log.splitlines() if "kvprune_cuda:" in line))  # with -s
