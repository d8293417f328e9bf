"""vLLM's greedy tokens for a model directory, offline (``vllm.LLM``): run by the serving tests
with the interpreter of ``.venv-serving`` (vLLM's CPU build), never imported by the test suite.

    python tests/helpers/vllm_greedy.py MODEL_DIR N_TOKENS ID,ID,...

prints one line ``GREEDY [id, ...]``: the ``N_TOKENS`` tokens vLLM generates greedily after
the prompt ``ID,ID,...`` (EOS ignored), the model in fp32, its context its
``max_position_embeddings``. vLLM's own errors go to stderr and the exit status is non-zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, n, ids = sys.argv[1], int(sys.argv[2]), [int(i) for i in sys.argv[3].split(",")]
    config = json.loads((Path(model) / "config.json").read_text())
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=config["max_position_embeddings"],
        enforce_eager=True,  # no torch.compile: the tiny models run in well under a second
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    print("GREEDY " + json.dumps(list(out.outputs[0].token_ids)), flush=True)


if __name__ == "__main__":  # vLLM starts its engine with spawn: the module must be importable
    main()
