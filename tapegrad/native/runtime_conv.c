/* tapegrad native runtime: kernels of the conv family (included after runtime.c). */
