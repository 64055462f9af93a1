# Support for the sanitizer presets (CMakePresets.json: asan, tsan, fuzz; scripts/sanitize).
#
# ATTN_TSAN_ABSL_ANNOTATIONS (preset tsan): Debian's absl is not built with ThreadSanitizer, so TSan
# cannot see absl::Mutex and reports everything it guards as racy. Every attn_cc_test then links
# sanitizers/absl_tsan_annotations.cc, which interposes absl::Mutex / absl::Notification and
# annotates them for TSan (see that file). It needs absl as shared libraries, as Debian ships it.
option(ATTN_TSAN_ABSL_ANNOTATIONS "Annotate the system absl::Mutex for ThreadSanitizer" OFF)
if(ATTN_TSAN_ABSL_ANNOTATIONS)
  add_library(attn_tsan_absl_annotations OBJECT
    ${CMAKE_CURRENT_LIST_DIR}/sanitizers/absl_tsan_annotations.cc)
  target_link_libraries(attn_tsan_absl_annotations PUBLIC absl::synchronization absl::time
    ${CMAKE_DL_LIBS})
  # Export the definitions so that calls from inside libabsl bind to them too.
  target_link_options(attn_tsan_absl_annotations INTERFACE -rdynamic)
endif()
