/* tapegrad native runtime: kernels of the scan family (included after runtime.c). */
