/* tapegrad native runtime: kernels of the special family (included after runtime.c). */
