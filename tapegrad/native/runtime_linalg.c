/* tapegrad native runtime: kernels of the linalg family (included after runtime.c). */
