# attn_cc_library(NAME name SRCS ... [HDRS ...] [DEPS ...])
#   A static library whose includes are rooted at the repository root ("server/engine/page_pool.h").
# attn_cc_test(NAME name SRCS ... [DEPS ...] [LABELS ...])
#   A GoogleTest binary registered with CTest, one CTest entry per test case. Its sources reuse the
#   precompiled headers of target ${ATTN_TEST_PCH} (default attn_test_pch; tests/pch/CMakeLists.txt).
function(attn_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;HDRS;DEPS" ${ARGN})
  add_library(${ARG_NAME} STATIC ${ARG_SRCS} ${ARG_HDRS})
  target_include_directories(${ARG_NAME} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${ARG_NAME} PUBLIC ${ARG_DEPS})
  target_compile_options(${ARG_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
endfunction()

function(attn_cc_test)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_include_directories(${ARG_NAME} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  if(TARGET attn_tsan_absl_annotations)  # cmake/AttnSanitizers.cmake
    target_link_libraries(${ARG_NAME} PRIVATE attn_tsan_absl_annotations)
  endif()
  target_compile_options(${ARG_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  if(NOT ATTN_TEST_PCH)
    set(ATTN_TEST_PCH attn_test_pch)
  endif()
  target_precompile_headers(${ARG_NAME} REUSE_FROM ${ATTN_TEST_PCH})
  gtest_discover_tests(${ARG_NAME} DISCOVERY_MODE PRE_TEST PROPERTIES LABELS "${ARG_LABELS}")
endfunction()
