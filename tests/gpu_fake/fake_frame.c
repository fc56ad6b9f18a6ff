/* Calls an XLA FFI handler with a call frame built here (host buffers, attributes, a stand-in API whose
 * stream and device ordinal the test chooses), as XLA would on the CUDA platform; compiled after
 * xla/ffi/api/c_api.h. Also answers the registration-time metadata query. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef XLA_FFI_Error *(*handler_t)(XLA_FFI_CallFrame *);

static char err_msg[4096];
static void *the_stream;
static int the_device;

static XLA_FFI_Error *f_error_create(XLA_FFI_Error_Create_Args *a) {
  snprintf(err_msg, sizeof err_msg, "%d: %s", (int)a->errc, a->message);
  return (XLA_FFI_Error *)err_msg;
}
static void f_error_destroy(XLA_FFI_Error_Destroy_Args *a) { (void)a; }
static void f_error_message(XLA_FFI_Error_GetDetails_Args *a) { a->message = err_msg; }
static XLA_FFI_Error *f_stream(XLA_FFI_Stream_Get_Args *a) { a->stream = the_stream; return NULL; }
static XLA_FFI_Error *f_device(XLA_FFI_DeviceOrdinal_Get_Args *a) { a->device_ordinal = the_device; return NULL; }

static XLA_FFI_Api api_for(void) {
  XLA_FFI_Api api;
  memset(&api, 0, sizeof api);
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_Error_Create = f_error_create;
  api.XLA_FFI_Error_Destroy = f_error_destroy;
  api.XLA_FFI_Error_GetDetails = f_error_message;
  api.XLA_FFI_Stream_Get = f_stream;
  api.XLA_FFI_DeviceOrdinal_Get = f_device;
  return api;
}

/* kinds[k]: 0 an i64 scalar, 1 an f64 scalar, 2 an i64 array of sizes[k]. Returns 0 or 1 (an error, in msg). */
int frame_call(handler_t h, int64_t nargs, void **args, const int64_t *arg_elems, int64_t nrets, void **rets,
               const int64_t *ret_elems, int dtype, int64_t nattr, const char **names, const int *kinds,
               void **values, const int64_t *sizes, void *stream, int device, char *msg, int64_t msglen) {
  XLA_FFI_Api api = api_for();
  the_stream = stream;
  the_device = device;
  XLA_FFI_Buffer bufs[nargs + nrets + 1];
  int64_t dims[nargs + nrets + 1];
  void *argv[nargs + 1], *retv[nrets + 1];
  XLA_FFI_ArgType at[nargs + 1];
  XLA_FFI_RetType rt[nrets + 1];
  for (int64_t k = 0; k < nargs + nrets; k++) {
    dims[k] = k < nargs ? arg_elems[k] : ret_elems[k - nargs];
    bufs[k].struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    bufs[k].extension_start = NULL;
    bufs[k].dtype = (XLA_FFI_DataType)dtype;
    bufs[k].data = k < nargs ? args[k] : rets[k - nargs];
    bufs[k].rank = 1;
    bufs[k].dims = &dims[k];
    if (k < nargs) { argv[k] = &bufs[k]; at[k] = XLA_FFI_ArgType_BUFFER; }
    else { retv[k - nargs] = &bufs[k]; rt[k - nargs] = XLA_FFI_RetType_BUFFER; }
  }
  XLA_FFI_ByteSpan spans[nattr + 1], *namev[nattr + 1];
  XLA_FFI_AttrType types[nattr + 1];
  XLA_FFI_Scalar scalars[nattr + 1];
  XLA_FFI_Array arrays[nattr + 1];
  void *attrv[nattr + 1];
  for (int64_t k = 0; k < nattr; k++) {
    spans[k].ptr = names[k];
    spans[k].len = strlen(names[k]);
    namev[k] = &spans[k];
    if (kinds[k] < 2) {
      types[k] = XLA_FFI_AttrType_SCALAR;
      scalars[k].dtype = kinds[k] ? XLA_FFI_DataType_F64 : XLA_FFI_DataType_S64;
      scalars[k].value = values[k];
      attrv[k] = &scalars[k];
    } else {
      types[k] = XLA_FFI_AttrType_ARRAY;
      arrays[k].dtype = XLA_FFI_DataType_S64;
      arrays[k].size = (size_t)sizes[k];
      arrays[k].data = values[k];
      attrv[k] = &arrays[k];
    }
  }
  XLA_FFI_CallFrame cf;
  memset(&cf, 0, sizeof cf);
  cf.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  cf.api = &api;
  cf.stage = XLA_FFI_ExecutionStage_EXECUTE;
  cf.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  cf.args.size = nargs;
  cf.args.types = at;
  cf.args.args = argv;
  cf.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  cf.rets.size = nrets;
  cf.rets.types = rt;
  cf.rets.rets = retv;
  cf.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  cf.attrs.size = nattr;
  cf.attrs.types = types;
  cf.attrs.names = namev;
  cf.attrs.attrs = attrv;
  XLA_FFI_Error *e = h(&cf);
  snprintf(msg, (size_t)msglen, "%s", e ? err_msg : "");
  return e != NULL;
}

/* The handler's answer to the metadata query: out = [api major, api minor, traits]. */
int frame_metadata(handler_t h, int64_t *out) {
  XLA_FFI_Api api = api_for();
  XLA_FFI_Metadata md;
  memset(&md, 0, sizeof md);
  XLA_FFI_Metadata_Extension ext;
  memset(&ext, 0, sizeof ext);
  ext.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  ext.extension_base.type = XLA_FFI_Extension_Metadata;
  ext.metadata = &md;
  XLA_FFI_CallFrame cf;
  memset(&cf, 0, sizeof cf);
  cf.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  cf.api = &api;
  cf.extension_start = &ext.extension_base;
  XLA_FFI_Error *e = h(&cf);
  out[0] = md.api_version.major_version;
  out[1] = md.api_version.minor_version;
  out[2] = (int64_t)md.traits;
  return e != NULL;
}
