"""vLLM's greedy tokens for a model directory, offline (``vllm.LLM``): run by the serving tests
with the interpreter of ``.venv-serving`` (vLLM's CPU build), never imported by the test suite.

    python tests/helpers/vllm_greedy.py MODEL_DIR N_TOKENS ID,ID,... MAX_MODEL_LEN [DTYPE [K [CC]]]

prints one line ``GREEDY [id, ...]``: the ``N_TOKENS`` tokens vLLM generates greedily after
the prompt ``ID,ID,...`` (EOS ignored), the model in ``DTYPE`` (default float32), vLLM's
context ``MAX_MODEL_LEN`` (it also decides some RoPE scalings: Phi-3.5-MoE's LongRoPE takes its
long factors for a context past ``original_max_position_embeddings``). With ``K`` > 0 also a
line ``LOGPROBS [{id: logprob, ...}, ...]``: at each generated position, the log-probabilities
of the chosen token and of the ``K`` most likely ones (the model's logits, before sampling).
``CC``: vLLM's compilation config as JSON (``{"custom_ops": ["-rotary_embedding"]}`` takes
the PyTorch implementation of RoPE instead of the CPU kernel).
vLLM's own errors go to stderr and the exit status is non-zero.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, n, ids = sys.argv[1], int(sys.argv[2]), [int(i) for i in sys.argv[3].split(",")]
    max_model_len = int(sys.argv[4])
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    top = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    compilation = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,  # no torch.compile: the tiny models run in well under a second
        seed=0,
        compilation_config=compilation,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=top if top else None
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    print("GREEDY " + json.dumps(list(out.outputs[0].token_ids)), flush=True)
    if top:
        steps = [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
        print("LOGPROBS " + json.dumps(steps), flush=True)


if __name__ == "__main__":  # vLLM starts its engine with spawn: the module must be importable
    main()
