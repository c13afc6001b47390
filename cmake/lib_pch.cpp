// The translation unit that builds the library's precompiled header (CMakeLists.txt).
