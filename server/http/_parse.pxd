# llhttp's C API (third_party/llhttp/include/llhttp.h, vendored: third_party/llhttp/README.md),
# the part server/http/_parse.pyx uses.

from libc.stdint cimport uint8_t, uint16_t, uint64_t


cdef extern from "llhttp.h":
    ctypedef struct llhttp_t:
        uint64_t content_length
        uint8_t method
        uint8_t http_major
        uint8_t http_minor
        uint8_t upgrade
        uint16_t flags
        uint16_t status_code
        void* data

    ctypedef int (*llhttp_data_cb)(llhttp_t*, const char*, size_t) noexcept
    ctypedef int (*llhttp_cb)(llhttp_t*) noexcept

    ctypedef struct llhttp_settings_t:
        llhttp_cb on_message_begin
        llhttp_data_cb on_url
        llhttp_data_cb on_header_field
        llhttp_data_cb on_header_value
        llhttp_cb on_headers_complete
        llhttp_data_cb on_body
        llhttp_cb on_message_complete
        llhttp_cb on_header_field_complete
        llhttp_cb on_header_value_complete
        llhttp_cb on_chunk_header
        llhttp_cb on_chunk_complete

    ctypedef enum llhttp_type_t:
        HTTP_REQUEST
        HTTP_RESPONSE

    ctypedef enum llhttp_errno_t:
        HPE_OK
        HPE_PAUSED_UPGRADE
        HPE_USER

    enum:
        F_CONTENT_LENGTH

    void llhttp_settings_init(llhttp_settings_t* settings)
    void llhttp_init(llhttp_t* parser, llhttp_type_t type, const llhttp_settings_t* settings)
    llhttp_errno_t llhttp_execute(llhttp_t* parser, const char* data, size_t len)
    int llhttp_should_keep_alive(const llhttp_t* parser)
    const char* llhttp_method_name(uint8_t method)
    const char* llhttp_get_error_reason(const llhttp_t* parser)
