/*
 * Rows [first, last) of a JPEG, decoded to RGB by the libjpeg that PIL itself loads.
 *
 * Compiled and loaded by services/engine/processing/jpeg_rows.py. The decoder settings are
 * PIL's (accurate integer IDCT, fancy upsampling), and the rows before ``first`` are skipped
 * with jpeg_skip_scanlines: their entropy-coded data is read, their IDCT, upsampling and
 * colour conversion are not, and libjpeg-turbo rebuilds the upsampling context of the first
 * row it returns. Several calls on one file, each on its own thread and its own rows, give
 * the pixels of one full decode.
 */
#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>

#include "jpeglib.h"

enum { ROWS_OK = 0, ROWS_ERROR = 1, ROWS_WARNING = 2, ROWS_MISMATCH = 3, ROWS_UNSUPPORTED = 4 };
enum { ROWS_PER_CALL = 16 };

struct guard {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int num_warnings;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct guard *guard = (struct guard *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, guard->message);
    longjmp(guard->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    struct guard *guard = (struct guard *)cinfo->err;
    if (level < 0 && guard->num_warnings++ == 0) { /* a warning: the first one is kept */
        (*cinfo->err->format_message)(cinfo, guard->message);
    }
}

/*
 * Decode rows [first, last) of the width x height, 3-component JPEG ``data`` into ``out``
 * (row ``first`` at ``out``, ``width * 3`` bytes per row). Returns ROWS_OK; ROWS_ERROR or
 * ROWS_WARNING (libjpeg's message in ``message``); ROWS_MISMATCH when the file is not the
 * size, or the rows not the range, the caller said; ROWS_UNSUPPORTED for a progressive or
 * arithmetic-coded file.
 */
int stageserve_jpeg_rows(const unsigned char *data, unsigned long size, unsigned int width,
                         unsigned int height, unsigned int first, unsigned int last,
                         unsigned char *out, char *message, unsigned long message_len) {
    struct jpeg_decompress_struct cinfo;
    struct guard guard;
    volatile int status = ROWS_OK;
    JSAMPROW rows[ROWS_PER_CALL];

    cinfo.err = jpeg_std_error(&guard.pub);
    guard.pub.error_exit = on_error;
    guard.pub.emit_message = on_message;
    guard.num_warnings = 0;
    guard.message[0] = '\0';
    jpeg_create_decompress(&cinfo);
    if (setjmp(guard.jump)) {
        status = ROWS_ERROR;
        goto done;
    }
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.progressive_mode || cinfo.arith_code) { /* a skip would decode every scan */
        snprintf(guard.message, sizeof(guard.message), "progressive or arithmetic-coded");
        status = ROWS_UNSUPPORTED;
        goto done;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_width != width || cinfo.output_height != height ||
        cinfo.output_components != 3 || first >= last || last > height) {
        snprintf(guard.message, sizeof(guard.message), "%ux%u with %d components, rows %u-%u",
                 cinfo.output_width, cinfo.output_height, cinfo.output_components, first, last);
        status = ROWS_MISMATCH;
        goto done;
    }
    if (first > 0 && jpeg_skip_scanlines(&cinfo, first) != first) {
        snprintf(guard.message, sizeof(guard.message), "could not skip %u rows", first);
        status = ROWS_MISMATCH;
        goto done;
    }
    while (cinfo.output_scanline < last) {
        unsigned int count = last - cinfo.output_scanline;
        if (count > ROWS_PER_CALL) count = ROWS_PER_CALL;
        for (unsigned int i = 0; i < count; i++) {
            rows[i] = out + (size_t)(cinfo.output_scanline - first + i) * width * 3;
        }
        if (jpeg_read_scanlines(&cinfo, rows, count) == 0) {
            snprintf(guard.message, sizeof(guard.message), "no row at %u", cinfo.output_scanline);
            status = ROWS_MISMATCH;
            goto done;
        }
    }
    if (guard.num_warnings) status = ROWS_WARNING;
done:
    if (status != ROWS_OK) snprintf(message, message_len, "%s", guard.message);
    jpeg_destroy_decompress(&cinfo);
    return status;
}
