"""speculum inside other engines: its drafters as vLLM proposers (:mod:`.vllm`) and its server as Ray
Serve replicas (:mod:`.ray_serve`). Nothing here imports vLLM or Ray until a module asks for it."""
