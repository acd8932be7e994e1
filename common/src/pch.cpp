// Compiles the precompiled header that every fivefold target reuses (see cmake/Fivefold.cmake).
