/* Virtio 1.x over MMIO (virtio spec 4.2.2) and split virtqueues (2.7), as used by the probe. */
#ifndef PVISOR_PROBE_VIRTIO_H
#define PVISOR_PROBE_VIRTIO_H

#include <stdint.h>

/* MMIO register offsets (version 2, "modern"). */
#define VIRTIO_MMIO_MAGIC_VALUE         0x000
#define VIRTIO_MMIO_VERSION             0x004
#define VIRTIO_MMIO_DEVICE_ID           0x008
#define VIRTIO_MMIO_VENDOR_ID           0x00c
#define VIRTIO_MMIO_DEVICE_FEATURES     0x010
#define VIRTIO_MMIO_DEVICE_FEATURES_SEL 0x014
#define VIRTIO_MMIO_DRIVER_FEATURES     0x020
#define VIRTIO_MMIO_DRIVER_FEATURES_SEL 0x024
#define VIRTIO_MMIO_QUEUE_SEL           0x030
#define VIRTIO_MMIO_QUEUE_NUM_MAX       0x034
#define VIRTIO_MMIO_QUEUE_NUM           0x038
#define VIRTIO_MMIO_QUEUE_READY         0x044
#define VIRTIO_MMIO_QUEUE_NOTIFY        0x050
#define VIRTIO_MMIO_INTERRUPT_STATUS    0x060
#define VIRTIO_MMIO_INTERRUPT_ACK       0x064
#define VIRTIO_MMIO_STATUS              0x070
#define VIRTIO_MMIO_QUEUE_DESC_LOW      0x080
#define VIRTIO_MMIO_QUEUE_DESC_HIGH     0x084
#define VIRTIO_MMIO_QUEUE_DRIVER_LOW    0x090
#define VIRTIO_MMIO_QUEUE_DRIVER_HIGH   0x094
#define VIRTIO_MMIO_QUEUE_DEVICE_LOW    0x0a0
#define VIRTIO_MMIO_QUEUE_DEVICE_HIGH   0x0a4
#define VIRTIO_MMIO_CONFIG_GENERATION   0x0fc
#define VIRTIO_MMIO_CONFIG              0x100

#define VIRTIO_MMIO_MAGIC 0x74726976u /* "virt" */

/* Device status bits. */
#define VIRTIO_STATUS_ACKNOWLEDGE 1u
#define VIRTIO_STATUS_DRIVER      2u
#define VIRTIO_STATUS_DRIVER_OK   4u
#define VIRTIO_STATUS_FEATURES_OK 8u
#define VIRTIO_STATUS_NEEDS_RESET 64u
#define VIRTIO_STATUS_FAILED      128u

/* Device ids and feature bits. */
#define VIRTIO_ID_CONSOLE 3u
#define VIRTIO_ID_BALLOON 5u
#define VIRTIO_F_VERSION_1 32
#define VIRTIO_BALLOON_F_REPORTING 5 /* free page reporting */
/*
 * Index of the reporting queue when only VERSION_1 + REPORTING are negotiated (queue indices
 * of absent optional queues are not consumed, as in Linux). Overridable for testing against
 * QEMU, whose balloon always creates statsq and so puts the reporting queue at index 3.
 */
#ifndef VIRTIO_BALLOON_REPORTING_QUEUE
#define VIRTIO_BALLOON_REPORTING_QUEUE 2u
#endif

/* Split virtqueue. */
#define VIRTQ_DESC_F_NEXT  1u
#define VIRTQ_DESC_F_WRITE 2u
#define VIRTQ_AVAIL_F_NO_INTERRUPT 1u
#define VIRTQ_USED_F_NO_NOTIFY 1u

struct virtq_desc {
    uint64_t addr;
    uint32_t len;
    uint16_t flags;
    uint16_t next;
};

struct virtq_avail {
    uint16_t flags;
    uint16_t idx;
    uint16_t ring[];
};

struct virtq_used_elem {
    uint32_t id;
    uint32_t len;
};

struct virtq_used {
    uint16_t flags;
    uint16_t idx;
    struct virtq_used_elem ring[];
};

_Static_assert(sizeof(struct virtq_desc) == 16, "virtq_desc");
_Static_assert(sizeof(struct virtq_used_elem) == 8, "virtq_used_elem");

#endif
