"""The machinery drafters share that is neither a drafter nor a runner: the target's own decoder run
as a draft (:mod:`.self_forward`: layer skipping, quantized copies, compressed views of the cache),
its weight-only quantized copies (:mod:`.quantized_copy`) and a subset of its layers over a cache of
their own (:mod:`.layer_subset`)."""
