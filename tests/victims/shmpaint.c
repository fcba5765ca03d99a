/* An X client that draws through MIT-SHM: a SysV segment shared with the X server holds an
 * image it paints with one colour per SIGUSR1, then XShmPutImage()s onto its window. */
#include <X11/Xlib.h>
#include <X11/Xutil.h>
#include <X11/extensions/XShm.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/shm.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	unsigned colour = strtoul(argv[1], NULL, 16);
	Display *d = XOpenDisplay(NULL);
	if (!d || !XShmQueryExtension(d))
		return 2;
	int s = DefaultScreen(d);
	Window w = XCreateSimpleWindow(d, RootWindow(d, s), 50, 50, 200, 150, 0, 0, 0);
	XStoreName(d, w, "shmpaint");
	XMapWindow(d, w);
	XSync(d, False);
	XShmSegmentInfo info;
	XImage *img = XShmCreateImage(d, DefaultVisual(d, s), DefaultDepth(d, s), ZPixmap, NULL, &info, 200, 150);
	info.shmid = shmget(IPC_PRIVATE, img->bytes_per_line * img->height, IPC_CREAT | 0600);
	info.shmaddr = img->data = shmat(info.shmid, NULL, 0);
	info.readOnly = False;
	XShmAttach(d, &info);
	XSync(d, False);
	shmctl(info.shmid, IPC_RMID, NULL); /* gone once both detach, like real MIT-SHM clients */
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigprocmask(SIG_BLOCK, &set, NULL);
	for (;;) {
		for (int i = 0; i < 200 * 150; i++)
			((unsigned *)img->data)[i] = colour;
		XShmPutImage(d, w, DefaultGC(d, s), img, 0, 0, 0, 0, 200, 150, False);
		XSync(d, False);
		FILE *f = fopen("/tmp/painted", "w");
		fprintf(f, "%06x\n", colour);
		fclose(f);
		int sig;
		sigwait(&set, &sig);
		colour = (colour * 7 + 0x123456) & 0xffffff;
	}
}
