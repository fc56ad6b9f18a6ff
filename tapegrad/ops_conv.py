"""Convolution and pooling: N-D convolution (strides, padding, dilations, feature groups), max and sum pooling.

Registry entries of this family (see ``tapegrad.ops`` for what an entry holds)."""
