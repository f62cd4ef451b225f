"""The engine's compute thread: one step's forward passes and sampling over the paged KV cache.

`Engine.plan` decides a step on the event loop and builds its `StepInput`; `ModelRunner.execute`
runs it on the engine's one compute thread and returns `StepOutputs`, which `Engine.apply` books.
The runner holds no request state: the flat batch of regular rows (prefill chunks and decodes,
through CUDA graphs where they apply), the ZigZag continuations (a request's remaining layers from
the hidden states a loading instance computed), the partial rows a loading instance runs with the
layers it holds, prompt log-probs, and sampling. It also sizes the compute thread's OpenMP team,
following the machine's core share between steps.
"""

from __future__ import annotations

import torch

from services.worker.engine.cpu_share import CpuShare
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.sampling import TopLogprobs, prompt_logprobs, sample
from services.worker.engine.step import StepInput, StepOutputs
from services.worker.model.attention import ForwardBatch
from services.worker.model.cuda_graphs import DecodeGraphs
from services.worker.model.llama import LlamaForCausalLM

# Prompt positions whose logits are computed at once for prompt log-probs: [rows, vocab] float32.
_PROMPT_LOGITS_ROWS = 256


class ModelRunner:
    """Runs the steps the engine plans, on its compute thread."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        *,
        max_batch_size: int,
        cuda_graphs: bool,
        cpu_share: CpuShare | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self._max_batch_size = max_batch_size
        self._cuda_graphs = cuda_graphs
        self._cpu_share = cpu_share
        self.threads = 0  # the compute thread's team size, once it has started
        # Built on the first decode-only step of a complete CUDA model (see `_graphs_for`).
        self.decode_graphs: DecodeGraphs | None = None

    def set_threads(self, n: int) -> None:
        """On the compute thread: the size of its OpenMP team (this thread's only)."""
        torch.set_num_threads(n)
        self.threads = n

    def execute(self, inp: StepInput) -> StepOutputs:
        """The compute thread's part of a step: forward over the flat batch, then sampling (and
        the prompt log-probs some prefills asked for, from the same hidden states); ZigZag
        continuations run their remaining layers; ZigZag requests on a loading instance run the
        layers it holds and keep their hidden states."""
        model = self.model
        device = model.device
        share = self._cpu_share.threads() if self._cpu_share is not None else self.threads
        if share != self.threads:
            self.set_threads(share)
        num_layers = model.config.num_hidden_layers
        logits_parts: list[torch.Tensor] = []
        prompt_out: list[list[tuple[float, TopLogprobs]]] = []
        graphs = self._graphs_for(inp) if inp.query_lens else None
        if graphs is not None:
            logits_parts.append(graphs.run(inp.input_ids, inp.context_lens, inp.block_tables))
        elif inp.query_lens:
            batch = ForwardBatch.build(
                inp.query_lens,
                inp.context_lens,
                inp.block_tables,
                self.kv_cache.block_size,
                logits_rows=inp.logits_local,
                device=device,
            )
            ids = torch.tensor(inp.input_ids, dtype=torch.long, device=device)
            if not inp.prompt_work:
                if inp.logits_local:
                    logits_parts.append(model.forward_batch(ids, batch, self.kv_cache))
                else:
                    model.run_layers(model.embed(ids), 0, num_layers, batch, self.kv_cache)
            else:
                # forward_batch's steps, keeping every position's hidden state for the prompt logits.
                hidden = model.run_layers(model.embed(ids), 0, num_layers, batch, self.kv_cache)
                if inp.logits_local:
                    logits_parts.append(model.head(hidden.index_select(0, batch.logits_indices)))
                starts = [0]
                for n in inp.query_lens:
                    starts.append(starts[-1] + n)
                for work in inp.prompt_work:
                    results: list[tuple[float, TopLogprobs]] = []
                    base = starts[work.row]
                    for a in range(0, len(work.targets), _PROMPT_LOGITS_ROWS):
                        b = min(a + _PROMPT_LOGITS_ROWS, len(work.targets))
                        rows = torch.arange(base + a, base + b, device=hidden.device)
                        results.extend(
                            prompt_logprobs(model.head(hidden.index_select(0, rows)), work.targets[a:b], work.k)
                        )
                    prompt_out.append(results)
        for cont in inp.continuations:
            batch = ForwardBatch.build(
                [cont.num_tokens], [cont.context_len], [cont.block_table], self.kv_cache.block_size, device=device
            )
            hidden = model.run_layers(cont.hidden.to(device), cont.layer_start, num_layers, batch, self.kv_cache)
            if cont.sample:
                logits_parts.append(model.head(hidden.index_select(0, batch.logits_indices)))
        partial_out: list[torch.Tensor] = []
        for part in inp.partials:
            batch = ForwardBatch.build(
                [part.num_tokens], [0], [part.block_table], self.kv_cache.block_size, device=device
            )
            if part.layer_start == 0 and part.seq.zz_embedded is not None:
                hidden = part.seq.zz_embedded.to(device)  # looked up by its partner (no embedding here yet)
            elif part.layer_start == 0:
                hidden = model.embed(torch.tensor(part.seq.prompt, dtype=torch.long, device=device))
            else:
                assert part.hidden is not None
                hidden = part.hidden
            partial_out.append(model.run_layers(hidden, part.layer_start, part.layer_end, batch, self.kv_cache))
        if not inp.sample_rows:
            return StepOutputs(None, prompt_out, partial_out)
        logits = logits_parts[0] if len(logits_parts) == 1 else torch.cat(logits_parts)
        return StepOutputs(sample(logits, inp.params, inp.generators, inp.histories), prompt_out, partial_out)

    def _graphs_for(self, inp: StepInput) -> DecodeGraphs | None:
        """The CUDA graphs that run this step, or None: only a step of decodes alone on a complete
        CUDA model whose every row samples, within the graphs' buckets."""
        model = self.model
        if not self._cuda_graphs or model.device.type != "cuda" or inp.prompt_work:
            return None
        n = len(inp.query_lens)
        if len(inp.logits_local) != n or any(q != 1 for q in inp.query_lens) or min(inp.context_lens) <= 0:
            return None
        if not model.static_decode_supported:
            return None
        if self.decode_graphs is None:
            self.decode_graphs = DecodeGraphs(model, self.kv_cache, self._max_batch_size)
        if self.decode_graphs.bucket(n, max(inp.context_lens) + 1) is None:
            return None
        return self.decode_graphs
