"""specdec inside vLLM: the contracts applied to vLLM's own speculative-decoding code.

Nothing here imports vLLM at module load; the adapter, the hooks and the harness
import it when they are used, so specdec without vLLM is unaffected.
"""
