/* The XLA FFI names tapegrad's handlers use, on every jaxlib interop supports (0.10.2 to 0.12.x).
 * Compiled right after xla/ffi/api/c_api.h. FFI API 0.4 (jaxlib 0.11.1) renamed the extension record
 * and the error-message query (same leading fields, so the same ABI); older headers get the new names. */
#if XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR < 4
typedef XLA_FFI_Extension_Base XLA_FFI_InternalExtension;
typedef XLA_FFI_Error_GetMessage_Args XLA_FFI_Error_GetDetails_Args;
#define XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE
#define XLA_FFI_Error_GetDetails XLA_FFI_Error_GetMessage
#endif
