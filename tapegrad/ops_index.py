"""Selection and indexing: where, take, gathers and scatters, dynamic and strided slices, flip, split, stack.

Registry entries of this family (see ``tapegrad.ops`` for what an entry holds)."""
