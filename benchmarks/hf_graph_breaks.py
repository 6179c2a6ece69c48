"""Graph breaks of a compiled transformers Llama/Mistral training step through the integration, with their
reasons, next to transformers' "sdpa": a smaller model than ``bench hf``'s, the same code path.

    python benchmarks/hf_graph_breaks.py [--device cuda]
"""

import argparse
import dataclasses

import torch
import torch._dynamo

from portable_ops.bench import hf
from portable_ops.integrations.transformers import register


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    import transformers

    name = register()
    for family in ("llama", "mistral"):
        shape = dataclasses.replace(hf.SHAPES[family], layers=2, seq=256, batch=2, hidden=256, intermediate=512,
                                    vocab=1000, window=64 if family == "mistral" else None)
        for attention in ("sdpa", name):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf.config(shape), attn_implementation=attention)
            model.to(device)
            tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=device)

            def step(tokens):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    return model(input_ids=tokens, labels=tokens).loss

            torch._dynamo.reset()
            explanation = torch._dynamo.explain(step)(tokens)
            print(f"{family} {attention}: {explanation.graph_count} graphs, {explanation.graph_break_count} breaks")
            seen = set()
            for reason in explanation.break_reasons:
                text = reason.reason.splitlines()[0][:300]
                where = reason.user_stack[-1] if reason.user_stack else None
                key = (text, str(where))
                if key not in seen:
                    seen.add(key)
                    print(f"    {text}\n      at {where}")


if __name__ == "__main__":
    main()
