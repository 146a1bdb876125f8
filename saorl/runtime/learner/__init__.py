"""The learner: one trainer step (single process, or its share on each rank of an FSDP2 run), the
optimizer routine every stage uses, the non-finite guard, and the ranks' process group."""
