/* PAGEMAP_SCAN (Linux 6.7+, linux/fs.h) under our own names, so the build does not depend on
 * the installed kernel headers being new enough; the ABI is fixed by the kernel. */
#ifndef BX_PAGEMAP_SCAN_H
#define BX_PAGEMAP_SCAN_H
#include <stdint.h>
#include <sys/ioctl.h>

struct bx_page_region {
	uint64_t start, end, categories;
};

struct bx_pm_scan_arg {
	uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
	uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};

#define BX_PAGEMAP_SCAN _IOWR('f', 16, struct bx_pm_scan_arg)
#define BX_PAGE_IS_PRESENT (1ULL << 3)
#define BX_PAGE_IS_PFNZERO (1ULL << 5)

#endif
