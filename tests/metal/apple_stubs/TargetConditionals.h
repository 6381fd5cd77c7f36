// Stub of <TargetConditionals.h> (see README.md): metal-cpp includes it but
// tests none of its macros in the headers we use.
#pragma once
