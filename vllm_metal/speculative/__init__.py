"""Speculative decoding (`--speculative-config`): drafts proposed on the host,
verified inside the step's one graph, accepted with vLLM's rejection rules.

serving_config.py says which methods are served and refuses the rest with
the reason; ngram.py proposes each request's next drafts from its own tokens
(vLLM's prompt-lookup matcher); rejection.py turns a verified row's target
tokens or logits into the tokens vLLM's rejection sampler would return; and
speculator.py is what the runner holds: which requests may draft, the
proposals handed to the scheduler (`take_draft_token_ids`), the counters.
The verify itself is no code of its own: a request's last token plus its
drafts are one row of query length k + 1 in the step's varlen batch
(engine/step_rows.py), scored by the same graph as every other row.
"""
