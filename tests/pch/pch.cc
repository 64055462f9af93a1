// The translation unit that compiles the precompiled headers of tests/pch/CMakeLists.txt; it
// defines nothing itself.
