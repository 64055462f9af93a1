// The translation unit that compiles the precompiled headers of tests/CMakeLists.txt; it defines
// nothing itself.
