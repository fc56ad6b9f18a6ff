/* tapegrad native runtime: kernels of the index family (included after runtime.c). */
