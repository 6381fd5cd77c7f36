// Stub of <dispatch/dispatch.h> (see ../README.md).
#pragma once
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
